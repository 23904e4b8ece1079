#!/usr/bin/env python3
"""Writes the seed corpora of the text fuzz targets (fuzz_tokenizer, fuzz_chat).

fuzz_tokenizer: one setup byte (bits 0-3 pre-tokenizer, 4 add_bos,
5 parse_special, 6 drop 0xFF's byte token, 7 and no unknown token), then the
text. fuzz_chat: one setup byte (bits 0-2 messages, 3 add_generation_prompt,
4 tokenizer, 5 NULL last role, 6 NULL last content), the template, NUL, the
contents separated by NULs; with bit 7 set (JSON mode), the template, NUL,
the context JSON of kvc_chat_apply_template_json. Run from anywhere; it writes next to itself.
"""
import os

here = os.path.dirname(os.path.abspath(__file__))

TEXTS = {
    "english": b"Hello world! The cat's in the hat, isn't it? We'll see... (42 items), 2024.",
    "unicode": "caf\u00e9 na\u00efve \u00fcber \u00c5\u00c4\u00d6 \u65e5\u672c\u8a9e \U0001f642 \u0661\u0662\u0663".encode(),
    "specials": b"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<tool>ab<|im<|endoftext|>",
    "spaces": b"  a\t\tb \n\n  c   \r\n\r\n x    \n",
    "numbers": b"1 12 123 1234 12345 3.14159 x1y22z333",
    "contractions": b"I'M YOU'RE he'S we'LL they'D 's 't",
    "invalid_utf8": b"ok \xff\xfe \xc3 \xe6\x97 \xf0\x9f\x99 \xed\xa0\x80 \xc0\xaf end\xff",
    "empty": b"",
}


SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{- bos_token }}\n{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n{%- else %}\n"
    "    {%- set system_message = \"\" %}\n{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- system_message }}\n{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n"
)
FEATURES = (
    "{% set ns = namespace(n=0, seen=[]) %}{# comment #}\n"
    "{% for m in messages if m.content is string %}{% set ns.n = ns.n + loop.index %}"
    "{{ loop.index0 }}:{{ m.role|upper }}={{ m['content'][:5]|replace('a', 'b')|title }}"
    "{% if loop.last %}.{% elif loop.previtem %},{% else %};{% endif %}{% endfor %}\n"
    "{%- for k, v in {'a': 1, 'b': [1, 2, 3]}.items() -%} {{ k ~ v|length if v is "
    "sequence else k ~ v }} {%+ endfor %}\n"
    "{{ ns.n // 2 }} {{ 7 % 3 }} {{ 'x' * 3 }} {{ [1, 2, 3]|join('-') }} "
    "{{ 'a,b,,c'.split(',') }} {{ '  pad  '.strip() }}|{{ none|default('d') }}\n"
    "{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}"
    "{% if i > 1 %}{% break %}{% endif %}{% else %}empty{% endfor %}\n"
    "{% set s %}captured {{ messages|length }}{% endset %}{{ s|trim }} "
    "{{ 'yes' if add_generation_prompt else 'no' }} {{ bos_token ~ eos_token }}\n"
    "{% if messages|length > 5 %}{{ raise_exception('too many messages') }}{% endif %}"
)
BROKEN = "{% for m in messages %}{{ m.content + 1 }}{% endfor %}\n{% macro x() %}{% endmacro %}"

TOOLS = (
    "{%- set tools = [{'type': 'function', 'function': {'name': 'get', 'description': 'Q \"x\"',"
    " 'parameters': {'type': 'object', 'properties': {'q': {'type': ['string', 'null']}}}}}] %}\n"
    "{%- if tools is not none %}{% for t in tools %}{{ t | tojson(indent=4) }}{{ t.function |"
    " tojson(ensure_ascii=true, sort_keys=true, separators=[',', ':']) }}{% endfor %}{% endif %}\n"
    "{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}\n"
    "{{- messages | rejectattr('content') | map(attribute='role', default='?') | join(',') }}"
    "{{ ['a', 'code', 'b'] | reject('equalto', 'code') | join(', ') }}\n"
    "{%- for k, v in {'a': [1, none]} | items %}{{ k }}={{ v | tojson }}{% endfor %}"
    "{{ users | length }}{{ 3 is divisibleby 3 }}{{ 'u' is in 'user' }}{{ strftime_now('%Y') | length }}\n"
    "{%- if false %}{{ 1.5 }}{{ 3 / 2 }}{{ (1, 2) }}{{ x | wordcount }}{% endif %}"
)
MACROS = (
    "{%- macro py_type(spec, d=0) %}{% if spec.type is string %}{{ spec.type }}"
    "{% elif spec.type is iterable and d < 3 %}Union[{% for t in spec.type %}"
    "{{ py_type({'type': t}, d + 1) }}{{ ',' if not loop.last }}{% endfor %}]{% else %}Any"
    "{% endif %}{% endmacro %}\n"
    "{%- macro turn(m, sep='\\n') -%}<|{{ m.role }}|>{{ sep }}{{ m.content | trim }}"
    "{%- endmacro %}\n"
    "{{ py_type({'type': ['a', ['b']]}) }}{% for m in messages %}{{ turn(m) }}"
    "{{ turn(m, sep=' ') | length }}{% endfor %}{{ turn }}{{ py_type(1, 2, 3) }}"
)
# filtered loops left with break and read later (in a namespace, after the
# loop, after a macro call returned), range methods
LOOPS = (
    "{%- set ns = namespace(l=none, a=none, n=0) %}{% set y = 0 %}"
    "{%- for m in messages if m.role != 'system' and y < 2 %}{% set ns.l = loop %}"
    "{%- if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{% set y = 5 %}"
    "{{ ns.l.length if ns.l }}{{ ns.l.last if ns.l }}{{ ns.l.nextitem if ns.l }}\n"
    "{%- macro m(k) %}{% for x in range(6) if x > k + ns.n %}{% set ns.a = loop %}{% break %}"
    "{%- endfor %}{% set k = 3 %}{% endmacro %}{{ m(0) }}{% set ns.n = 1 %}{{ ns.a.revindex }}\n"
    "{{- range(10, 0, -3).index(4) }}{{ range(5).count(true) }}\n"
    "{%- if messages | length > 5 %}{{ range(5).index(7) }}{% endif %}"
    "{%- if messages | length == 1 %}{% for o in [0, 1] %}{% if o == 0 %}"
    "{%- for x in [1, 2, 3] if x > o %}{% set ns.l = loop %}{% break %}{% endfor %}{% endif %}"
    "{%- endfor %}{{ ns.l.length }}{% endif %}"
)

CHATS = {
    "smollm2": SMOLLM2,
    "llama3": LLAMA3,
    "features": FEATURES,
    "broken": BROKEN,
    "empty": "",
    "text_only": "plain text {{ 'and' }} {% raw %}{{ raw }}{% endraw %}",
    "tools": TOOLS,
    "macros": MACROS,
    "loops": LOOPS,
}
CONTENTS = [b"You are terse.", b"Hello \xc3\xa9 <|im_start|> world", b"Hi! {{ not code }}",
            b"a" * 40, b"", b"last"]


# JSON mode: a tool template and contexts that reach every part of the reader
TOOL_CALLS = (
    "{%- for m in messages %}<{{ m.role }}>{{ m.content if m.content is string else m.content | tojson }}"
    "{%- for c in m.tool_calls | default([]) %}[{{ c.function.name }}({{ c.function.arguments | tojson }})"
    "{{ c.id | default('') }}]{% endfor %}{{ m.reasoning_content | default('') }}"
    "{%- if m.role == 'tool' %}#{{ m.tool_call_id }}{% endif %}{% endfor %}"
    "{%- if tools %}{% for t in tools %}{{ t | tojson(indent=1) }}{% endfor %}{% endif %}"
    "{{ enable_thinking | default(true) }}{{ bos_token }}{{ documents | length if documents }}"
    "{%- if add_generation_prompt %}<assistant>{% endif %}"
)
CONTEXTS = {
    "tools": (
        '{"messages": [{"role": "system", "content": "Use tools."}, {"role": "user", '
        '"content": "Weather in Paris?"}, {"role": "assistant", "content": null, "tool_calls": '
        '[{"id": "call12345", "type": "function", "function": {"name": "get_weather", '
        '"arguments": {"city": "Paris", "days": 3}}}]}, {"role": "tool", "tool_call_id": '
        '"call12345", "content": "sunny"}, {"role": "assistant", "content": "Sunny.", '
        '"reasoning_content": "tool said so"}], "tools": [{"type": "function", "function": '
        '{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": '
        '{"type": "string"}}, "required": ["city"]}}}], "enable_thinking": false}'),
    "escapes": (
        r'{"messages":[{"role":"user","content":"\\u00e9 \u00e9\ud83c\udf89 \"q\" \/ '
        r'\b\f\n\r\t \u0000 caf\u00e9 ' '\u00e9 \U0001f389"}],"bos_token":"<s>",'
        r'"documents":[{},[],-9223372036854775808,9223372036854775807,true,null]}'),
    "duplicates": ('{"messages":[{"role":"user","content":"a","role":"assistant"}],'
                   '"x":1,"x":{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8,"i":9,"a":0}}'),
    "float": '{"messages": [], "tools": [{"minimum": 0.5, "max": 1e3}], "n": NaN}',
    "bigint": '{"messages": [{"role": "user", "content": "x", "n": 18446744073709551616}]}',
    "invalid": r'{"messages": [{"role": "user", "content": "\ud800"}, 01, "a' '\t' r'b",]}',
    "deep": '{"messages": [], "v": ' + "[" * 499 + "{}" + "]" * 499 + "}",
}


def chat_seeds():
    d = os.path.join(here, "chat")
    os.makedirs(d, exist_ok=True)
    for i, (name, tmpl) in enumerate(CHATS.items()):
        # message counts 0..6, generation prompt, tokenizer, NULL role/content
        for j, mode in enumerate((3 | 8 | 16, (i + 1) % 7, 6 | 16 | 32 | 64)):
            with open(os.path.join(d, f"{name}_{j}"), "wb") as f:
                f.write(bytes([mode]) + tmpl.encode() + b"\0" + b"\0".join(CONTENTS))
    for i, (name, context) in enumerate(CONTEXTS.items()):
        mode = 128 | 8 * (i % 2) | 16 * (i % 3 == 0)
        with open(os.path.join(d, f"json_{name}"), "wb") as f:
            f.write(bytes([mode]) + TOOL_CALLS.encode() + b"\0" + context.encode())


def main():
    chat_seeds()
    d = os.path.join(here, "tokenizer")
    os.makedirs(d, exist_ok=True)
    for i, (name, text) in enumerate(TEXTS.items()):
        # spread the setups: every pre-tokenizer family, both flags, the 0xFF modes
        for j, mode in enumerate(((i * 3) % 16 | 0x30, (i * 5 + 1) % 16 | 0x40, (i + 2) % 16 | 0xC0)):
            with open(os.path.join(d, f"{name}_{j}"), "wb") as f:
                f.write(bytes([mode]) + text)


if __name__ == "__main__":
    main()
