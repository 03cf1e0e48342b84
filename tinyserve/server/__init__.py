"""The HTTP layer over one engine: OpenAI chat/completions, completions, models and
Responses, Anthropic Messages.

app.py (routes) -> prepare.py (template, forced tool call, fit, sampling) -> generate.py
(submit, stream or collect) -> formatters.py and the other APIs' *_events.py (chunks, events
and bodies) over responses.py (reasoning and tool-call parsing of the generated text). The
Anthropic and Responses requests are translated into chat requests (*_api.py).
"""

