"""The config page (placeholder until its part lands)."""

import streamlit as st

st.title("config")
