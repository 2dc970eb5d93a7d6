"""The job spec and its parts: the torch-free contract that the API, the worker and the loops share."""
