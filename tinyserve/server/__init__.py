"""FastAPI app, request/response models, chat template, tool and reasoning parsers, metrics."""
