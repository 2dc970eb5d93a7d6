"""The composition root: the ``proxima`` console script, which starts the API, workers and the inference server and
runs the trainer's local commands. It sits above ``api``, ``worker`` and ``trainer``, and nothing imports it."""
