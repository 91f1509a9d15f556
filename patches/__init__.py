"""Runtime patches shipped inside the wheel as ``gspo_ascend.patches``.

Each patch module explains itself (what, why, upstream reference, version gate, when to remove) and is
applied by an explicit call from an engine, never as an import side effect.
"""
