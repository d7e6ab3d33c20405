"""The studio's Streamlit app: the key check, then the three pages (`python -m studio` serves it)."""

from pathlib import Path

import streamlit as st

from studio.access import gate

HERE = Path(__file__).resolve().parent

st.set_page_config(page_title="nanorft studio", layout="wide")
gate()
pages = [
    st.Page(HERE / "config_page.py", title="Config", default=True),  # NOTE: the default page is served at / only
    st.Page(HERE / "viewer_page.py", title="Experiences", url_path="experiences"),
    st.Page(HERE / "run_page.py", title="Run", url_path="run"),
]
st.navigation(pages).run()
