"""specfleet: speculative decoding with a fleet of draft models."""
from specfleet.llm import LLM
from specfleet.outputs import RequestOutput
from specfleet.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
