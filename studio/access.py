"""Who may use the served studio: anyone on this machine (loopback), anyone else only with the key.

The key is the server's (`python -m studio --key KEY`, or NANORFT_STUDIO_KEY), handed to the app in the environment.
A browser sends it once as `?key=KEY` in the address; the session then keeps it (a page switch drops the
address's query). NOTE: every page's data goes through the app's script, which `gate` stops before any page runs:
without the key a session sees the refusal only. Streamlit's static files (its JavaScript) are served to anyone, as
they hold no data.
"""

from __future__ import annotations

import hmac
import os

KEY_ENV = "NANORFT_STUDIO_KEY"


def server_key() -> str | None:
    """The key this server requires; None: none (a loopback server)."""
    return os.environ.get(KEY_ENV) or None


def allowed(key: str | None, given: str) -> bool:
    """Whether `given` (the address's ?key=) is the server's `key` (compared in constant time); no key: yes."""
    return key is None or hmac.compare_digest(given.encode(), key.encode())


def gate() -> None:
    """Stop the script (st.stop) with a refusal unless this session holds the server's key."""
    import streamlit as st

    key = server_key()
    if key is None or st.session_state.get("studio_key_ok"):
        return
    if allowed(key, st.query_params.get("key", "")):
        st.session_state["studio_key_ok"] = True
        del st.query_params["key"]  # out of the address bar and the browser's history
        return
    st.error("This studio needs its key: open it as http://HOST:PORT/?key=KEY (the key it was started with).")
    st.stop()
