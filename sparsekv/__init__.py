"""sparsekv: exact, truly sparse serving for DSA models (GLM-5.x `glm_moe_dsa`, DeepSeek-V3.2 `deepseek_v32`)."""
from .config import ConfigError, EngineConfig, ModelConfig
from .request import InvalidRequest, RequestOutput, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "ModelConfig", "RequestOutput",
           "InvalidRequest", "ConfigError"]


def __getattr__(name):  # keep `import sparsekv` torch-free until the engine is needed
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "LLMEngine":
        from .engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
