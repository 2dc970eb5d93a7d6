"""Serving: the inference engine, Tinker training sessions and the cookbook glue."""
