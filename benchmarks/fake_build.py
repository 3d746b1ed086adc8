"""Building a Llama-2-7B model in fake mode on spoofed CUDA, against building it on the meta device.

Run with ``python benchmarks/fake_build.py`` (needs ``transformers``). Prints the peak memory the fake build adds
to the process (after importing torch and transformers and a first, small use of fake mode), and the build time
after warm-up as a ratio against the meta-device build, the floor, measured in the same process, the two builds
alternating. On the meta device transformers skips initializing the weights, which it does in fake mode.
"""

from __future__ import annotations

import torch
from _timing import LLAMA_2_7B, paired_ns, peak_mib
from transformers import LlamaConfig, LlamaForCausalLM

from modattrs.fake import fake_mode

CONFIG = LlamaConfig(**LLAMA_2_7B)


def build_meta() -> None:
    with torch.device("meta"):
        LlamaForCausalLM(CONFIG)


def build_fake() -> None:
    with fake_mode(fake_cuda=True), torch.device("cuda"):
        LlamaForCausalLM(CONFIG)


def main() -> None:
    torch.set_num_threads(1)
    with fake_mode(fake_cuda=True), torch.device("cuda"):
        torch.nn.Linear(8, 8)  # first use: compiles or loads the device guard, imports the fake machinery
    before = peak_mib()
    build_fake()
    print(f"peak memory added by the first fake build: {peak_mib() - before:.1f} MiB (target: at most 50 MiB)")

    # Alternating, so that both see the same state of the machine; warm.
    fake, meta = paired_ns(build_fake, build_meta, number=1, repeat=11)
    ratio = fake / meta
    verdict = "within target" if ratio <= 2 else "ABOVE target"
    print(
        f"build time, fake on spoofed cuda vs meta: {fake / 1e6:.1f} ms vs {meta / 1e6:.1f} ms = {ratio:.2f}x "
        f"(target: at most 2x) {verdict}"
    )


if __name__ == "__main__":
    main()
