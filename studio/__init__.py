"""nanorft studio: a web page over the config schema, the experience DB and the monitor files (Streamlit).

    bash run.sh studio                     # installs the `studio` extra once, then serves http://127.0.0.1:8501
    python -m studio [--host H] [--port P] [--key KEY]

Three pages, each a Streamlit script of its own (studio/app.py lays them out; tests/test_studio_*.py drive each with
Streamlit's AppTest, and tests/test_studio_browser.py the served app in headless Chromium):
  - config_page.py: the config generator, built from configs/schema.py by schema_form.py (no key registered by hand),
    validated by the loader and checks as `launch.py` validates, saved as YAML, launched as a child process;
  - viewer_page.py: the experience viewer over any experience DB, opened read-only (expdb.py: paged queries);
  - run_page.py: a job directory's curves and summary from its monitor files (runs.py), live while it runs.
Only the page scripts import streamlit; the modules they read (schema_form, expdb, runs, launcher) are plain Python.
The server binds to loopback; elsewhere only with a key (access.py), as the OpenAI-compatible API does.
"""
