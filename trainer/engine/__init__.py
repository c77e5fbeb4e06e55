"""Engine control: the vLLM server lifecycle and weight sync into the running server."""
from trainer.engine.managed import managed_engine, serving_engine
from trainer.engine.server import EngineConfig, EngineError, VLLMServer, default_engine_venv
from trainer.engine.sync import VLLMEngine, WeightSync, stage_model, write_weights

__all__ = ["EngineConfig", "EngineError", "VLLMEngine", "VLLMServer", "WeightSync", "default_engine_venv",
           "managed_engine", "serving_engine", "stage_model", "write_weights"]
