"""The run page (placeholder until its part lands)."""

import streamlit as st

st.title("run")
