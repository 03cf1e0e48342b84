"""The OpenAI-compatible HTTP layer over one engine.

app.py (routes) -> generate.py (submit, stream or collect, abort on disconnect) ->
formatters.py / responses.py (chunks and bodies) -> reasoning.py + tool_parser.py (Qwen3.5
`</think>` split and XML tool calls). chat.py renders the checkpoint's chat template,
protocol.py holds the request models, errors.py the OpenAI error objects, auth.py the API key
and body limit, metrics.py the Prometheus text, state.py the config and shared state,
launch.py `tinyserve run` / `tinyserve demo`.
"""
