import json
from datetime import datetime

import pytest

from exl3cli.engine.text.chat_template import ChatTemplate
from exl3cli.errors import ChatTemplateError
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer

# A Qwen2.5-style template with tool support, written for this test.
QWEN_TOOLS_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}You are helpful.{%- endif %}
    {{- '\\n\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and tools) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MESSAGES = [{"role": "user", "content": "Hi there"}]


def test_chatml_template_from_tokenizer_config(tmp_path):
    folder = write_tiny_tokenizer(tmp_path)
    template = ChatTemplate.from_folder(folder)
    assert not template.is_fallback
    assert template.render(MESSAGES) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    assert template.render(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    )


def test_tools_are_rendered_with_tojson_keeping_non_ascii():
    tool = {"type": "function", "function": {"name": "café_lookup", "parameters": {}}}
    template = ChatTemplate(QWEN_TOOLS_TEMPLATE)
    text = template.render(MESSAGES, tools=[tool])
    expected_tool_line = (
        '{"type": "function", "function": {"name": "café_lookup", "parameters": {}}}'
    )
    assert text == (
        "<|im_start|>system\nYou are helpful.\n\n# Tools\n<tools>\n"
        + expected_tool_line
        + "\n</tools><|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert json.loads(expected_tool_line) == tool
    # Without tools the same template is plain ChatML.
    assert template.render(MESSAGES) == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )


def test_named_template_list_picks_default(tmp_path):
    entries = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT {{ messages[0].content }}"},
    ]
    folder = write_tiny_tokenizer(tmp_path, chat_template=entries)
    assert ChatTemplate.from_folder(folder).render(MESSAGES) == "DEFAULT Hi there"


def test_jinja_file_wins_over_tokenizer_config_and_given_template_wins_over_both(tmp_path):
    folder = write_tiny_tokenizer(tmp_path)
    (folder / "chat_template.jinja").write_text("FILE {{ messages[0].content }}")
    assert ChatTemplate.from_folder(folder).render(MESSAGES) == "FILE Hi there"
    given = ChatTemplate.from_folder(folder, template="MODELFILE {{ messages[0].content }}")
    assert given.render(MESSAGES) == "MODELFILE Hi there"


def test_bos_and_eos_tokens_are_variables(tmp_path):
    folder = write_tiny_tokenizer(
        tmp_path,
        bos_token="<|endoftext|>",
        chat_template="{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}",
    )
    assert ChatTemplate.from_folder(folder).render(MESSAGES) == "<|endoftext|>Hi there<|im_end|>"


def test_trim_and_lstrip_blocks_like_transformers():
    source = "{% for m in messages %}\n    {{ m['content'] }}\n    {% if loop.last %}END{% endif %}\n{% endfor %}"
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    # trim_blocks eats the newline after a block tag, lstrip_blocks the indent before one.
    assert ChatTemplate(source).render(messages) == "    a\n    b\nEND"


def test_raise_exception_becomes_chat_template_error():
    source = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    )
    template = ChatTemplate(source)
    assert template.render(MESSAGES) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation must start with user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_syntax_error_is_reported():
    with pytest.raises(ChatTemplateError, match="syntax error"):
        ChatTemplate("{% for m in messages %}never closed")


def test_sandbox_blocks_mutation():
    template = ChatTemplate("{{ messages.append({'role': 'x'}) }}")
    with pytest.raises(ChatTemplateError):
        template.render(MESSAGES)
    assert MESSAGES == [{"role": "user", "content": "Hi there"}]


def test_strftime_now_and_loop_controls_and_generation_tag():
    source = (
        "{{ strftime_now('%Y') }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}|"
        "{% generation %}gen{% endgeneration %}"
    )
    messages = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    assert ChatTemplate(source).render(messages) == f"{datetime.now().year}|one|gen"


def test_extra_variables_reach_the_template():
    template = ChatTemplate("{{ enable_thinking }}")
    assert template.render(MESSAGES, enable_thinking=False) == "False"


def test_fallback_when_model_has_no_template(tmp_path):
    folder = write_tiny_tokenizer(tmp_path, chat_template=None)
    template = ChatTemplate.from_folder(folder)
    assert template.is_fallback
    assert template.render([{"role": "user", "content": "The sky is"}]) == "The sky is"
    conversation = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert template.render(conversation) == (
        "System: Be kind.\nUser: Hi\nAssistant: Hello!\nUser: Bye\nAssistant:"
    )

