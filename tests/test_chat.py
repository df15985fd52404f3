"""Chat templates (bebop_jax/data/chat.py): messages rendered by the template itself, in a
sandbox, with clear errors."""

import json

import pytest

from bebop_jax.data import chat

# SmolLM2-135M-Instruct's template, as its GGUF file carries it.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
# A template with another end-of-turn marker, and one that refuses a role.
OTHER = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant] {% endif %}")
STRICT = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
          "{{ raise_exception('no tools here') }}{% endif %}{{ m['content'] }}{% endfor %}")


def test_smollm2s_template_renders_system_and_user_with_a_generation_prompt():
  text = chat.render(SMOLLM2, [{"role": "system", "content": "Answer briefly."},
                               {"role": "user", "content": "What is 2 + 3?"}],
                     add_generation_prompt=True)
  assert text == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n"
                  "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
  # Without a system message the template adds its own default one.
  assert chat.render(SMOLLM2, [{"role": "user", "content": "Hi"}]).startswith(
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
  assert chat.end_of_turn(SMOLLM2) == "<|im_end|>"
  assert chat.end_of_turn(OTHER) == "</s>"


def test_load_template_reads_tokenizer_config(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": OTHER}))
  assert chat.load_template(str(tmp_path)) == OTHER
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
      {"name": "tool_use", "template": STRICT}, {"name": "default", "template": SMOLLM2}]}))
  assert chat.load_template(str(tmp_path)) == SMOLLM2
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
  with pytest.raises(chat.ChatTemplateError, match="has no chat_template"):
    chat.load_template(str(tmp_path))


@pytest.mark.parametrize("template, messages, match", [
    (SMOLLM2, [{"role": "robot", "content": "x"}], "message 0 .* each needs a role in"),
    (SMOLLM2, [{"role": "user", "content": 3}], "string content"),
    (STRICT, [{"role": "tool", "content": "x"}], "refused the messages: no tools here"),
    ("{% for m in messages %}", [], "does not parse"),
    ("{{ messages.__class__.__mro__ }}", [], "failed on these messages"),  # the sandbox
])
def test_bad_templates_and_messages_are_named(template, messages, match):
  with pytest.raises(chat.ChatTemplateError, match=match):
    chat.render(template, messages)
