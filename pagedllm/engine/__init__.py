"""The request path: Processor → EngineCore (schedule → execute → update) → OutputProcessor."""
