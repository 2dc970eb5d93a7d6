"""Grading: the graders and what runs them (grading processes, the sandbox, remote graders, URL policy); torch-free."""
