"""Chat: the template (rendered as `transformers` renders it) and the parsing of a turn's output.

`template` renders conversations; `deltas` holds the parsed-output types and the parser
interface; `reasoning` and `tool_parsers` are the parsers; `families` picks them per model
line. The OpenAI wire format of all this lives in `pdflash.server.chat`.
"""
