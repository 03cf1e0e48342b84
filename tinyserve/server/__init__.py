"""The OpenAI-compatible HTTP layer over one engine.

app.py (routes) -> prepare.py (a chat request: template, forced tool call, fit, sampling) ->
generate.py (submit, stream or collect, abort on disconnect) -> formatters.py / responses.py
(chunks and bodies) -> reasoning.py + tool_parser.py (Qwen3.5 `</think>` split and XML tool
calls). anthropic_api.py and responses_api.py translate the Anthropic Messages and OpenAI
Responses requests (anthropic_protocol.py, responses_protocol.py) into chat requests;
anthropic_events.py and responses_events.py write their events and bodies. tool_choice.py
forces tool calls by prefilling the call's preamble. chat.py renders the checkpoint's chat
template, prompt_ids.py turns client text into token ids (its special-token strings as text,
long prompts refused early), protocol.py holds the request models and their validation (the
other APIs' bodies build on it), errors.py the OpenAI (and Anthropic) error objects,
openapi.py the served schema, auth.py the API key and body limit, metrics.py the Prometheus
text, state.py the config and shared state, launch.py `tinyserve run` / `tinyserve demo`
(and the drain on SIGTERM).
"""
