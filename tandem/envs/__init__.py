"""Environments: datasets, rollouts against an OpenAI-shaped client, and scoring.

The API mirrors the classic `verifiers` library (up to 0.3) so its users feel at home; the
built-in environments are `reverse_text`, `alphabet_sort`, `wordle`, `math` and `wiki_search`, loaded with
`load_environment(env_id, **kwargs)`.
"""

from tandem.envs.dataset import build_prompt, format_dataset
from tandem.envs.environment import Environment, ScoredRollout
from tandem.envs.multi_turn import MultiTurnEnv
from tandem.envs.parsers import Parser, ThinkParser, XMLParser
from tandem.envs.registry import BUILTIN_ENVIRONMENTS, load_environment
from tandem.envs.rubric import Rubric, RubricGroup
from tandem.envs.single_turn import SingleTurnEnv
from tandem.envs.tool_env import ToolEnv
from tandem.envs.tool_schema import tool_schema
from tandem.envs.types import ChatMessage, Example, Info, Messages, RolloutScore, State, StopReason

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "ChatMessage",
    "Environment",
    "Example",
    "Info",
    "Messages",
    "MultiTurnEnv",
    "Parser",
    "RolloutScore",
    "Rubric",
    "RubricGroup",
    "ScoredRollout",
    "SingleTurnEnv",
    "State",
    "StopReason",
    "ThinkParser",
    "ToolEnv",
    "XMLParser",
    "build_prompt",
    "format_dataset",
    "load_environment",
    "tool_schema",
]
