"""configs/qwen3_hf.py: SFT -> MTP -> RL from a Hugging Face checkpoint directory made here
(experiments/make_tiny_qwen3.py: random Qwen3 weights and a BPE tokenizer.json trained on
the task text), on that checkpoint's vocabulary; and the same config on Qwen3-8B's published
config.json, compiled ahead of time on a simulated mesh.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from bebop_jax.stages import config as config_lib
from bebop_jax import sharding
from bebop_jax import stages
from bebop_jax.data import tokenizer as tokenizer_lib
from bebop_jax.model import config as model_config
from bebop_jax.model import hf
from bebop_jax.model import model as policy_lib
from bebop_jax.stages import lineage
from bebop_jax.train import optimizer as optimizer_lib
from bebop_jax.stages import sft as sft_lib
from bebop_jax.train import trainer
from experiments import make_tiny_qwen3
from bebop_jax.stages import drafter_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "qwen3_hf.py")
TINY_SCALE = os.path.join(REPO, "configs", "rl_tiny.py")


def _tiny_scale(config, data_dir):
  """rl_tiny's step counts and batches (seconds per stage), keeping the model and tokenizer."""
  small = config_lib.load_file(TINY_SCALE)
  for section in ("data", "sft", "mtp", "rl", "eval"):
    keep = {k: config[section][k] for k in ("tokenizer", "init_from_hf", "hf_mtp")
            if k in config[section]}
    config[section] = small[section]
    config[section].update(keep)
  config.data.data_dir = str(data_dir)
  return config


def test_the_pipeline_runs_from_a_checkpoint_on_its_vocabulary(tmp_path, capsys):
  ckpt = make_tiny_qwen3.make_checkpoint(str(tmp_path / "ckpt"), d_model=32, mlp_dim=64,
                                         head_dim=8)
  assert sorted(os.listdir(ckpt)) == ["config.json", "model.safetensors", "tokenizer.json"]
  config = config_lib.load_file(CONFIG, ckpt)
  assert config.stages == ("sft", "mtp", "rl")
  config = config_lib.validate(_tiny_scale(config, tmp_path / "data"))
  tok = tokenizer_lib.HFTokenizer(ckpt)
  assert config.model.vocab_size == tok.vocab_size
  workdir = str(tmp_path / "run")
  stages.run(config, workdir)
  out = capsys.readouterr().out
  assert f"[sft] starting from {ckpt}" in out
  for stage in ("sft", "mtp", "rl"):
    assert os.path.exists(os.path.join(workdir, stage, "summary.json")), stage

  # SFT started from the checkpoint's weights: after 4 small steps the trunk is still near
  # them (a random initialisation is not).
  cfg, imported = hf.import_checkpoint(ckpt, mtp="fresh")
  _, trained = lineage.restore_policy(config, workdir, stage="sft")
  a = np.asarray(imported["layers"]["wq"][...])
  b = np.asarray(jax.device_get(trained["layers"]["wq"][...]))
  assert np.abs(a - b).max() < 0.1 * np.abs(a).max()

  # The rollouts the MTP stage trained on are in the checkpoint's vocabulary: merged BPE
  # pieces (ids past the character tokenizer's 104), prompts that decode to task text.
  records = drafter_data.drafter_store(config, workdir).read_split("train")
  tokens = np.concatenate([r["tokens"] for r in records])
  assert tokens.max() < tok.vocab_size and (tokens >= 128).any()
  texts = [tok.decode(r["tokens"]) for r in records]
  assert all(t.startswith("<|bos|>") for t in texts)
  assert any(t.count("<|") >= 2 for t in texts)  # a marker inside the text, one token


def test_a_drafter_trains_for_a_pretrained_chat_model_alone(tmp_path, capsys):
  """stages=("mtp",) from a checkpoint, without SFT, in its chat format (configs/smollm2.py
  runs this with `--config.stages='("mtp","eval")'`): the MTP stage's rollouts come from the
  imported weights, their prompts rendered by the checkpoint's chat template."""
  ckpt = make_tiny_qwen3.make_checkpoint(str(tmp_path / "ckpt"), d_model=32, mlp_dim=64,
                                         head_dim=8)
  with open(os.path.join(ckpt, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": CHATML}, f)
  config = _tiny_scale(config_lib.load_file(CONFIG, ckpt), tmp_path / "data")
  config.data.chat_format = True
  config.stages = ("mtp",)
  config = config_lib.validate(config)
  workdir = str(tmp_path / "run")
  stages.run(config, workdir)
  assert "[mtp] no SFT stage in" in capsys.readouterr().out
  assert os.path.exists(os.path.join(workdir, "mtp", "summary.json"))
  assert not os.path.exists(os.path.join(workdir, "sft"))
  tok = tokenizer_lib.load_tokenizer(ckpt, chat_format=True)
  records = drafter_data.drafter_store(config, workdir).read_split("train")
  texts = [tok.decode(r["tokens"]) for r in records]
  head = f"<|im_start|>system\n{tokenizer_lib.CHAT_SYSTEM}<|im_end|>\n<|im_start|>user\n"
  assert texts and all(t.startswith(head) for t in texts)
  assert all("<|im_start|>assistant\n" in t for t in texts)


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_config_needs_a_checkpoint_directory(tmp_path):
  with pytest.raises(ValueError, match="needs a checkpoint directory"):
    config_lib.load_file(CONFIG)
  with pytest.raises(ValueError, match="config.json does not exist"):
    config_lib.load_file(CONFIG, str(tmp_path))


# Qwen3-8B's config.json as published (the weights are not needed to compile).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen3_8b_config_compiles_ahead_of_time_on_a_simulated_mesh(tmp_path):
  ckpt = tmp_path / "Qwen3-8B"
  os.makedirs(ckpt)
  with open(ckpt / "config.json", "w") as f:
    json.dump(QWEN3_8B, f)
  make_tiny_qwen3.train_tokenizer(str(ckpt))
  config = config_lib.load_file(CONFIG, str(ckpt))
  config.mesh.shape, config.mesh.axes = (-1, 4), ("fsdp", "tensor")
  config = config_lib.validate(config)
  cfg = model_config.ModelConfig.from_dict(config.model.to_dict())
  assert (cfg.d_model, cfg.num_layers, cfg.vocab_size, cfg.param_dtype) == (
      4096, 36, 151936, "bfloat16")
  assert cfg == model_config.preset("qwen3_8b", attention_block_size=cfg.attention_block_size,
                                    decode_preslice_weights=cfg.decode_preslice_weights)
  mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
  rules = tuple(tuple(r) for r in config.mesh.rules)
  graphdef, abstract = policy_lib.abstract_state(cfg)
  model = nnx.merge(graphdef, abstract)
  graphdef, trainable, frozen = nnx.split(
      model, optimizer_lib.trainable_filter(config.sft.optim.trainable), ...)
  tx, schedule = optimizer_lib.make_optimizer(config_lib.settings(config).sft.optim,
                                              config.sft.train.num_steps)
  state = trainer.TrainState(trainable, frozen, jax.eval_shape(tx.init, trainable), 0)
  batch = {k: np.zeros((config.data.batch_size, 128), np.int32)
           for k in ("tokens", "positions", "segment_ids", "loss_mask")}
  step = trainer.make_train_step(graphdef, sft_lib.make_loss_fn(config), tx, schedule)
  compiled = trainer.compile_train_step(step, state, batch, mesh, rules, tx)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  assert compiled.memory["argument_size_in_bytes"] < 3.2 * total / 8  # params + Adam, split
