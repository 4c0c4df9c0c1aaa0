"""A minimal stand-in for the engine's Request: only the fields the spec package reads."""
from dataclasses import dataclass, field

from tailrl.config import SamplingParams


@dataclass(eq=False)
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    group_id: str = ""
    prompt_id: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    priority: float = 0.0
    length_prior: tuple = ()
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=4096))

    def emit(self, sources, tokens):
        """Append tokens and tell every source, as the engine does after a step."""
        self.output_token_ids.extend(tokens)
        for s in sources:
            s.observe(self, list(tokens))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]
