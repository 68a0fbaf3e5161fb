//! Model checks live in `tests/`; run them with `loom-tests/run`.
