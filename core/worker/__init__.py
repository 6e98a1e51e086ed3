"""Model execution: the worker, its model runner, sampling, model loading and the multi-process executor."""
