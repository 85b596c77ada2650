"""The pass framework, kept apart from the passes it runs.

    base.py        what a pass is: a frozen dataclass whose fields are its options, `run`,
                   `requires`/`ensures`, PassResult, PassFailure, helpers for rewrites
    registry.py    pass names, the pipeline text format (`lift-state{beam=keep},fuse-kvcache`)
    manager.py     the PassManager: runs a pipeline, checks invariants, prints and dumps IR
    invariants.py  the named invariants passes require and ensure
    rules.py       named rewrite rules (match with a reason, rewrite) and their hit counts
    plugins.py     passes from outside kvc: a Python file (--pass-plugin) or an entry point

Writing a pass: docs/writing-a-pass.md.
"""
