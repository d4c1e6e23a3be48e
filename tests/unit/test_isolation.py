"""raybench.runtime.isolation on the real modules: what a trial changes process-wide is found and put back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama

from raybench.runtime import isolation
from raybench.runtime.techniques import compile
from raybench.spec.sweep_spec import TrainSpec


def test_patched_names_flags_and_environment_are_restored():
    linear, rms_norm = F.linear, modeling_llama.LlamaRMSNorm
    precision = torch.backends.cuda.matmul.fp32_precision
    before = isolation.snapshot()
    # What DeepSpeed ZeRO-3 and Liger do to the process, and what a model's code may do to torch's switches.
    F.linear = lambda *args, **kwargs: linear(*args, **kwargs)
    modeling_llama.LlamaRMSNorm = type("PatchedRMSNorm", (torch.nn.Module,), {})
    torch.backends.cuda.matmul.fp32_precision = "tf32" if precision != "tf32" else "ieee"  # TF32 on
    os.environ["NCCL_RAYBENCH_TEST"] = "1"
    changed = isolation.restore(before)
    assert F.linear is linear and modeling_llama.LlamaRMSNorm is rms_norm
    assert torch.backends.cuda.matmul.fp32_precision == precision and "NCCL_RAYBENCH_TEST" not in os.environ
    assert set(changed) == {"torch.nn.functional.linear", "transformers.models.llama.modeling_llama.LlamaRMSNorm",
                            "torch.backends.cuda.matmul.fp32_precision", "os.environ[NCCL_RAYBENCH_TEST]"}


def test_nothing_changed_reports_nothing():
    before = isolation.snapshot()
    torch.ones(3) @ torch.ones(3)  # ordinary work touches no process-wide state
    assert isolation.restore(before) == []


def test_a_compiled_cpu_kernel_changes_nothing_that_counts():
    os.environ.pop("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", None)  # as in a process that compiled nothing yet
    before = isolation.snapshot()
    # Loading the kernel sets inductor's own pointer variable: put back, not a reason to replace a warm group.
    torch.compile(lambda x: x.sin() + 1)(torch.ones(4))
    assert "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR" in os.environ
    assert isolation.restore(before) == []
    assert "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR" not in os.environ


def test_a_modeling_module_first_imported_during_the_trial_is_restored():
    """A warm actor's first trial of a model type imports its modeling module after the snapshot, and Liger
    patches it right away: the patch is found and put back. In a fresh interpreter that ran a Llama model before
    (so transformers' shared modules are loaded), where Qwen2's modeling module was never loaded."""
    script = textwrap.dedent("""
        import json, sys
        from transformers.models.llama import modeling_llama
        from raybench.runtime import isolation
        assert "transformers.models.qwen2.modeling_qwen2" not in sys.modules
        before = isolation.snapshot()
        from transformers.models.qwen2 import modeling_qwen2 as m  # the trial's import
        rope, norm, forward = m.apply_rotary_pos_emb, m.Qwen2RMSNorm, m.Qwen2ForCausalLM.forward
        # What apply_liger_kernel_to_qwen2 does: module-level function and class, and the causal LM's forward.
        m.apply_rotary_pos_emb = lambda *args: args
        m.Qwen2RMSNorm = type("LigerRMSNorm", (), {})
        m.Qwen2ForCausalLM.forward = lambda self, **kwargs: None
        changed = isolation.restore(before)
        restored = (m.apply_rotary_pos_emb is rope and m.Qwen2RMSNorm is norm
                    and m.Qwen2ForCausalLM.forward is forward)
        print(json.dumps({"changed": sorted(changed), "restored": restored}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    result = json.loads(out.splitlines()[-1])
    prefix = "transformers.models.qwen2.modeling_qwen2."
    assert result == {"changed": [f"{prefix}Qwen2ForCausalLM.forward", f"{prefix}Qwen2RMSNorm",
                                  f"{prefix}apply_rotary_pos_emb"], "restored": True}


def test_class_attributes_and_new_names_are_restored():
    forward, mlp_forward = modeling_llama.LlamaForCausalLM.forward, modeling_llama.LlamaMLP.forward
    before = isolation.snapshot()
    modeling_llama.LlamaForCausalLM.forward = lambda self, **kwargs: None  # Liger's fused linear cross-entropy
    del modeling_llama.LlamaMLP.forward
    modeling_llama.LlamaMLP.fused = True
    F.patched_by_a_library = F.linear
    changed = isolation.restore(before)
    assert modeling_llama.LlamaForCausalLM.forward is forward and modeling_llama.LlamaMLP.forward is mlp_forward
    assert not hasattr(modeling_llama.LlamaMLP, "fused") and not hasattr(F, "patched_by_a_library")
    prefix = "transformers.models.llama.modeling_llama."
    # A new class attribute is removed but does not count: libraries cache values on classes (transformers does).
    assert set(changed) == {f"{prefix}LlamaForCausalLM.forward", f"{prefix}LlamaMLP.forward",
                            "torch.nn.functional.patched_by_a_library (new)"}


def test_dynamo_and_inductor_settings_changed_in_a_trial_are_restored():
    import torch._dynamo.config
    import torch._inductor.config

    recompile_limit_fails = torch._dynamo.config.fail_on_recompile_limit_hit
    max_autotune = torch._inductor.config.max_autotune
    before = isolation.snapshot()
    torch._dynamo.config.fail_on_recompile_limit_hit = not recompile_limit_fails
    torch._inductor.config.max_autotune = not max_autotune
    changed = isolation.restore(before)
    assert torch._dynamo.config.fail_on_recompile_limit_hit == recompile_limit_fails
    assert torch._inductor.config.max_autotune == max_autotune
    assert set(changed) == {"torch._dynamo.config.fail_on_recompile_limit_hit", "torch._inductor.config.max_autotune"}


def test_a_compiled_trials_own_settings_are_scoped_to_it():
    """raybench's compile technique sets dynamo's fail_on_recompile_limit_hit for its trial alone."""
    model = modeling_llama.LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                        num_attention_heads=2, vocab_size=64))
    train = TrainSpec(strategy="fsdp2", compile=True)
    before = isolation.snapshot()
    with compile.trial_scope(train):
        compile.apply(model, train)
        assert torch._dynamo.config.fail_on_recompile_limit_hit
    assert isolation.restore(before) == []
