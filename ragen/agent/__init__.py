"""The agent layer: prompts, response parsing, multi-turn rollout, the Trajectory record."""

from ragen.agent.context import ChatTokens, PromptFormat
from ragen.agent.parser import ParsedResponse, parse_response
from ragen.agent.rollout import Rollout
from ragen.agent.settings import AgentConfig
from ragen.agent.trajectory import Trajectory, Turn

__all__ = ["ChatTokens", "PromptFormat", "ParsedResponse", "parse_response", "AgentConfig", "Rollout", "Trajectory", "Turn"]
