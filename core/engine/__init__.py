"""The engine: input processing, the engine core (scheduler + executor), output processing, and
where the core runs (this thread, another thread, or a process of its own)."""
