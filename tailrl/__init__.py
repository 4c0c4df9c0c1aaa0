"""tailrl: fast, lossless rollouts for RL training of reasoning LLMs."""
from tailrl.config import EngineConfig, SamplingParams, SpeculativeConfig

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "EngineConfig", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; keep `import tailrl` light for the CLI and the simulator.
    if name == "LLM":
        from tailrl.llm import LLM
        return LLM
    raise AttributeError(f"module 'tailrl' has no attribute {name!r}")
