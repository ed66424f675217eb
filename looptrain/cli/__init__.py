"""The command lines."""

import logging


class _DropKernelNotice(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" warning.

    bitsandbytes logs it on import (through peft, for --lora) on CPUs with AVX-512 BF16 when the optional
    ``kernels`` package is missing; its own CPU code runs instead, so the line only alarms.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropKernelNotice())
