"""The GLM-style chat template of glm52-tiny, shared by the renderer, the tokenizer tool and tests.

Layout (GLM-4.5/4.6 style):

    [gMASK]<sop><|system|>\n# Tools ... one JSON schema per line ... how to call
    <|system|>\n{system}<|user|>\n{user}<|assistant|>\n{content}<tool_call>name<arg_key>k</arg_key>
    <arg_value>v</arg_value></tool_call><|observation|>\n<tool_response>\n{result}\n</tool_response>
    <|assistant|>\n ...

An assistant turn has no closing token: the next role token (or `<|endoftext|>` at the end of a
training document) ends it, which is why those are the eos ids (see `special_tokens.EOS_TOKENS`).
Consecutive tool results share one `<|observation|>`. String argument values are written as-is,
all others as JSON, so the parser can restore their types.

Reasoning (GLM style): an assistant turn after the last user message renders its
`reasoning_content` as `<think>{reasoning}</think>\n` before its content (earlier turns drop it,
as GLM's template does: the model reasons afresh for each user message). `enable_thinking` (a
`chat_template_kwargs` key) shapes the generation prompt: false appends `<think></think>\n` (the
block is closed, the answer comes at once), true appends `<think>` (the output starts inside
reasoning); unset appends nothing (the model decides; glm52-tiny was trained that way). Every piece of output is an explicit
`{{- ... -}}` expression so the result does not depend on jinja's whitespace options.
"""

from __future__ import annotations

CHAT_TEMPLATE = r"""{#- glm52-tiny chat template (GLM style) -#}
{%- macro text(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{- content -}}
{%- elif content is mapping -%}{{- content | tojson -}}
{%- else -%}
{%- for part in content -%}
{%- if part is string -%}{{- part -}}
{%- elif part.type == 'text' -%}{{- part.text -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
{{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' -}}
{%- for tool in tools -%}
{{- (tool.function if tool.function is defined else tool) | tojson -}}{{- '\n' -}}
{%- endfor -%}
{{- '</tools>\n\nFor each function call, output the function name and arguments in this format:\n' -}}
{{- '<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{{- '<|system|>\n' + text(m.content) -}}
{%- elif m.role == 'user' -%}
{{- '<|user|>\n' + text(m.content) -}}
{%- elif m.role == 'assistant' -%}
{{- '<|assistant|>\n' -}}
{%- if m.reasoning_content is string and m.reasoning_content | trim and loop.index0 > ns.last_user -%}
{{- '<think>' + m.reasoning_content | trim + '</think>\n' -}}
{%- endif -%}
{{- text(m.content) -}}
{%- for tc in m.tool_calls or [] -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
{{- '<tool_call>' + fn.name -}}
{%- if fn.arguments is mapping -%}
{%- for k, v in fn.arguments.items() -%}
{{- '<arg_key>' + k + '</arg_key><arg_value>' + (v if v is string else v | tojson) + '</arg_value>' -}}
{%- endfor -%}
{%- elif fn.arguments -%}
{{- raise_exception('tool call arguments must be a JSON object, not a string: ' + fn.name) -}}
{%- endif -%}
{{- '</tool_call>' -}}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
{{- '\n<tool_response>\n' + text(m.content) + '\n</tool_response>' -}}
{%- else -%}
{{- raise_exception('unknown message role: ' + m.role | string) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>\n' -}}
{%- if enable_thinking is defined and enable_thinking is not none -%}
{{- '<think>' if enable_thinking else '<think></think>\n' -}}
{%- endif -%}
{%- endif -%}
"""
