"""The `lattice` command: `main` dispatches train, eval, generate, convert, info, plan and bench;
`arguments` derives the flags from the config dataclasses; `launch` starts local processes."""
