"""gpt-oss's harmony tool calls (vLLM's `openai` parser): a message on the `commentary` channel
to a recipient `functions.NAME`, its body the arguments' JSON, closed by <|call|>:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may also come before the channel: `<|start|>assistant to=functions.x<|channel|>...`).
It reads harmony text (pagedllm/reasoning/harmony.py), as the `openai_gptoss` reasoning parser
leaves the content: final-channel and preamble bodies are content, analysis bodies (no
reasoning parser) are dropped, text outside messages is content. Use the two together; the
reasoning parser keeps the special-token markers in the output text.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedText, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.json_calls import decode_first, dump_arguments, parse_partial, settled_prefix
from pagedllm.reasoning.harmony import parse_messages

FUNCTIONS = "functions."


class OpenAIToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        content: list[str] = []
        calls: list[ParsedCall] = []
        for message in parse_messages(text, final):
            recipient = message.recipient
            if recipient is None:
                if message.channel != "analysis":
                    content.append(message.body)
                continue
            name = recipient.removeprefix(FUNCTIONS)
            done = final or message.closed
            decoded = decode_first(message.body) if done else None
            if decoded is not None and not message.body[decoded[1]:].strip():
                calls.append(ParsedCall(name, dump_arguments(decoded[0])))
            elif done:  # not JSON: the arguments as written, whole
                calls.append(ParsedCall(name, message.body.strip()))
            else:  # still streaming: the settled part of the arguments
                partial = parse_partial(message.body)
                calls.append(ParsedCall(name, "" if partial is None else settled_prefix(partial)))
        return ParsedText("".join(content), calls)
