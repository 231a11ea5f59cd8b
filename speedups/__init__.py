"""Optional speed-ups switched on by flags or chosen where they pay: the decode step compiled
ahead of time (aot.py, --compile auto/aot), the int8 and the windowed static caches (kv_int8.py,
kv_window.py), drafts from the prompt (prompt_lookup.py) or from a draft model (draft_model.py).
Each has a plain twin in the core that its tests check it against.
"""
