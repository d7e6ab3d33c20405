"""The studio's Streamlit app: the key check, then the three pages (`python -m studio` serves it)."""

from pathlib import Path

import streamlit as st

from studio.access import gate

HERE = Path(__file__).resolve().parent

st.set_page_config(page_title="nanorft studio", layout="wide")
gate()
pages = [
    st.Page(HERE / "config_page.py", title="Config", url_path="config", default=True),
    st.Page(HERE / "viewer_page.py", title="Experiences", url_path="experiences"),
    st.Page(HERE / "run_page.py", title="Run", url_path="run"),
]
st.navigation(pages).run()
