"""The config page: a form over configs/schema.py (studio/schema_form.py reads it; no key registered here).

Load a YAML (configs/, Trinity-RFT's examples, any path; `?config=PATH` opens one), edit it in beginner mode (the keys
a first run needs) or expert mode (every key, by section), see the loader's own error beside the field it names (each
rerun validates as launch.py does), the YAML with its secrets as ***, save it, launch it (studio/launcher.py) and
stop it as Ctrl-C would. Widget keys: `cf:<path>` per field (`cf:algorithm.optimizer.lr`,
`cf:buffer.explorer_input.tasksets[0].name`); the page's own: `cfp:view` (mode), `cfp:pick`, `cfp:load`,
`cfp:save_path`, `cfp:save`, `cfp:launch`, `cfp:stop`, `cfp:add:<path>`, `cfp:remove:<path>[i]`; the error beside a
field is an st.error right under its widget.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import streamlit as st
import yaml

from configs import checks
from configs.loader import load_yaml
from configs.schema import Config
from errors import ConfigError
from studio import launcher
from studio import schema_form as sf

NUMBER_FORMAT = "%g"  # 1e-06 as 1e-06, not 0.00


def _secret(path: str) -> bool:
    """Whether --dry-run hides this field's value (checks.shown_value's rule)."""
    return checks.shown_value(path, "x") == repr("***")


def _load(path: str) -> None:
    """Load a YAML into the form (its widgets start afresh), or show the loader's refusal."""
    try:
        with sf.caught_warnings() as warned:
            cfg = sf.load(path)
    except ConfigError as e:
        st.session_state["cf_load_error"] = str(e) if str(e).startswith(path) else f"{path}: {e}"
        return
    st.session_state["cf_raw"] = dataclasses.asdict(cfg)
    st.session_state["cf_source"] = path
    st.session_state.pop("cf_load_error", None)
    st.session_state["cf_load_warnings"] = warned  # normalize's: old names, ignored keys, veRL keys
    _forget("cf:")
    st.query_params["config"] = path


def _forget(prefix: str) -> None:
    """Drop the widgets' states under `prefix`: they are drawn afresh from the form's values."""
    for key in [k for k in st.session_state if str(k).startswith(prefix)]:
        del st.session_state[key]


def _yaml_widget(f: sf.Field, path: str, value: Any, key: str, slots: dict) -> Any:
    """A list, mapping or ArgsDict as a YAML text area; text that is no YAML keeps the old value and says why."""
    shown = checks.redacted(value, f.name) if _secret(path) else value
    text = yaml.safe_dump(shown, sort_keys=False, allow_unicode=True, default_flow_style=True).strip()
    given = st.text_area(path, text, key=key, help=f.help, height=68)
    if given == text:
        return value
    try:
        return load_yaml(given) if given.strip() else None
    except Exception as e:  # noqa: BLE001 - PyYAML's errors and the loader's bounds: shown, not raised
        slots[path] = st.empty()
        slots[path].error(f"{path}: not valid YAML: {' '.join(str(e).split())}")
        st.session_state["cf_yaml_errors"].add(path)
        return value


def _widget(f: sf.Field, path: str, raw: dict, slots: dict) -> None:
    """One field's widget by its type, its value written back into `raw` when the user changed it (an unset
    optional stays unset); an empty slot under it for its error."""
    value, key = sf.get(raw, path), f"cf:{path}"
    if f.kind == "literal":
        options = list(f.choices)
        shown = value if value in options else options[0]
        new = st.selectbox(path, options, index=options.index(shown), key=key, help=f.help)
    elif f.kind == "bool":
        shown = bool(value)
        new = st.checkbox(path, value=shown, key=key, help=f.help)
    elif f.kind == "int":
        shown = value
        new = st.number_input(path, value=shown, step=1, key=key, help=f.help)
    elif f.kind == "float":
        shown = None if value is None else float(value)
        new = st.number_input(path, value=shown, format=NUMBER_FORMAT, key=key, help=f.help)
    elif f.kind == "str":
        shown = value or ""
        new = st.text_input(path, shown, key=key, help=f.help, type="password" if _secret(path) else "default")
    else:
        shown, new = value, _yaml_widget(f, path, value, key, slots)
    if new is not shown and new != shown:
        sf.put(raw, path, new)
    slots.setdefault(path, st.empty())


def _items(f: sf.Field, path: str, raw: dict, slots: dict, depth: int) -> None:
    """A list of sections: per item an expander with the item's fields and a remove button; an add button."""
    items = sf.get(raw, path)
    st.markdown(f"**{path}**: {f.doc}")
    for i in range(len(items)):
        box = st.expander(f"{path}[{i}]", expanded=False) if depth == 0 else st.container(border=True)
        with box:
            _fields(f.item, f"{path}[{i}]", raw, slots, depth + 1)
            if st.button(f"remove {path}[{i}]", key=f"cfp:remove:{path}[{i}]"):
                items.pop(i)
                _forget(f"cf:{path}[")  # the later items' widgets now show other items
                st.rerun()
    if st.button(f"add an item to {path}", key=f"cfp:add:{path}"):
        items.append(sf.item_default(f.item))
        st.rerun()
    slots.setdefault(path, st.empty())


def _fields(cls: type, prefix: str, raw: dict, slots: dict, depth: int = 0, only: tuple = ()) -> None:
    """The widgets of the direct fields of section `cls` at `prefix` (sections drawn inside, recursively);
    `only`: the top-level keys to draw (an expert section)."""
    for f in sf.schema_fields(cls):
        if "." in f.path or "[" in f.path or (only and f.path not in only):
            continue
        path = f"{prefix}.{f.name}" if prefix else f.name
        if f.kind == "section":
            st.markdown(f"**{path}**: {f.doc}")
            _fields(f.item, path, raw, slots, depth)
        elif f.kind == "items" and isinstance(sf.get(raw, path), list):
            _items(f, path, raw, slots, depth)
        else:
            _widget(f, path, raw, slots)


# --- the page, top to bottom

st.title("Config")
if "cf_raw" not in st.session_state:
    st.session_state["cf_raw"] = dataclasses.asdict(Config())
    st.session_state["cf_source"] = ""
    if st.query_params.get("config"):
        _load(st.query_params["config"])
st.session_state["cf_yaml_errors"] = set()

examples = [str(p.relative_to(sf.ROOT)) for p in sf.example_configs()]
left, right = st.columns([3, 1])
picked = left.selectbox("load a config (configs/, Trinity-RFT's examples) or type a path", examples, key="cfp:pick",
                        index=None, accept_new_options=True)  # fmt: skip
if right.button("load", key="cfp:load") and picked:
    _load(picked)
if st.session_state.get("cf_load_error"):
    st.error(st.session_state["cf_load_error"])
st.caption(f"editing: {st.session_state['cf_source'] or 'the defaults'}")
for message in st.session_state.get("cf_load_warnings", []):
    st.warning(message)
mode = st.radio("keys shown", ["beginner", "expert"], key="cfp:view", horizontal=True)
general = st.empty()  # an error that names no field drawn here

raw, slots = st.session_state["cf_raw"], {}
if mode == "beginner":
    for path in sf.BEGINNER:
        _widget(sf.field_at(path), path, raw, slots)
else:
    with st.expander("every key: docstring, type, default, choices, range"):
        rows = [
            {"key": f.path, "section": f.section, "type": f.type_text, "default": sf.shown_default(f),
             "choices": ", ".join(map(str, f.choices)), "range": f.range_text, "doc": f.doc}
            for f in sf.schema_fields()
        ]  # fmt: skip
        st.dataframe(rows, key="cfp:reference", hide_index=True)
    tops = [f for f in sf.schema_fields() if "." not in f.path and "[" not in f.path]
    tabs = st.tabs(list(sf.SECTIONS))
    for tab, section in zip(tabs, sf.SECTIONS):
        with tab:
            _fields(Config, "", raw, slots, only=tuple(f.path for f in tops if f.section == section))

verdict = sf.validate(raw)
if verdict.error and verdict.field in slots:
    slots[verdict.field].error(verdict.error)
elif verdict.error:
    where = f"\n\n({verdict.field} is a key of expert mode)" if verdict.field else ""
    general.error(verdict.error + where)
for message in verdict.warnings:  # what the checks warn about: it runs, maybe not as meant
    st.warning(message)

st.subheader("YAML (secrets as ***)")
if verdict.cfg is not None:
    st.code(sf.to_text(verdict.cfg, hide=True), language="yaml")
else:
    st.caption("fix the error above to see the YAML")

source = st.session_state["cf_source"]
default_out = f"studio_configs/{Path(source).stem or 'config'}.yaml"
out = st.text_input("save to", default_out, key="cfp:save_path")
ok = verdict.cfg is not None and not st.session_state["cf_yaml_errors"]
save_col, launch_col, stop_col = st.columns(3)
if save_col.button("save", key="cfp:save", disabled=not ok):
    st.success(f"saved {sf.save(verdict.cfg, out)}")
if launch_col.button("launch", key="cfp:launch", disabled=not ok):
    launcher.start(sf.save(verdict.cfg, out))
run = launcher.current(out)
if stop_col.button("stop (Ctrl-C)", key="cfp:stop", disabled=run is None or not run.running):
    launcher.stop(run)


@st.fragment(run_every=2.0 if run is not None and run.running else None)
def console(saved: str, was_running: bool) -> None:
    """The launch's console, refreshed every 2 s while it runs; the whole page once more when it ends (the stop
    button off, the refreshing over)."""
    now = launcher.current(saved)
    if now is None:
        return
    if was_running and not now.running:
        st.rerun()
    state = "running" if now.running else f"ended (exit code {now.code})"
    st.markdown(f"**console** of launch.py --config {now.config}: {state}")
    st.code(launcher.tail(now.log) or "(nothing yet)", language=None)


console(out, run is not None and run.running)
