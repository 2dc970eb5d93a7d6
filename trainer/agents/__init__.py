"""Agents: tools, tool-call formats, multi-turn episodes and the calculator tool server."""
