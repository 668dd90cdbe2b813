"""What importing a light module pulls in, read in a fresh interpreter (a subprocess: the test's own
one has everything loaded already): the wire contracts load neither torch nor vLLM, rollout's tool-call
parser no bus."""

from __future__ import annotations

import subprocess
import sys


def test_events_module_imports_neither_torch_nor_vllm():
    code = "import sys, marlaas.platform.events; print(sorted({'torch', 'vllm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_reading_the_tool_protocol_loads_no_bus():
    """Rollout's parser (``marlaas.tools.protocol``) is pure: importing it loads neither the bus
    nor the NATS client (the package's SDK names load when first used)."""
    import subprocess
    import sys

    probe = ("import sys, marlaas.tools.protocol; "
             "print(sorted(m for m in sys.modules if m == 'nats' or m.startswith(('nats.', 'marlaas.platform.bus', "
             "'marlaas.tools.serving', 'marlaas.tools.registry'))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_the_gateway_app_loads_no_torch_until_a_tinker_training_call():
    """The gateway builds its app (every route, Tinker's included) without torch: ``tinker.proto``
    runs the SDK's ``__init__`` (torch, 2 s a gateway start), so its messages load on the first
    ``forward_backward`` only (``tinker_api.tinker_messages``)."""
    probe = ("import sys; from marlaas.platform.config import load_config; "
             "from services.gateway.app import create_app; import services.gateway.service; "
             "from services.gateway.context import Gateway; from services.gateway.metrics import StackMetrics; "
             "create_app(Gateway(None, None, load_config(env={}), StackMetrics())); "
             "before = sorted({'torch', 'tinker', 'transformers'} & set(sys.modules)); "
             "from services.gateway.tinker_api import tinker_messages; tinker_messages().ForwardBackwardRequest(); "
             "print(before, 'tinker' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] True", done.stdout
