"""`demo`'s flags, declared once (`DemoFlags`): its options, `--help` and docs table are generated from them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal


from dflash_audit.flags import DEVICE_HELP, DTYPE_HELP, Device, Dtypes, VerbFlags, flag
from impl.families import DEMO_FAMILIES


class DemoFlags(VerbFlags):
    """`demo`'s flags."""

    world_dir: Path | None = flag(None, help="the demo world's folder (default <cache-dir>/demo)")
    # The old name of --world-dir, kept working but unlisted: --cache reads as a cache root elsewhere.
    old_world_dir: Path | None = flag(None, "--cache", hidden=True, help="deprecated: --world-dir")
    cache_dir: Path | None = flag(None, help="cache root (default $XDG_CACHE_HOME/dflash-audit)")
    rebuild: bool = flag(False, help="retrain everything in the cache")
    out: Path | None = flag(None, help="report directory (default reports/demo, reports/demo-dflash2 for "
                                       "--family dflash2)")
    family: Literal[DEMO_FAMILIES] = flag("dflash", help="dflash, or dflash2: the second act, the same story on a "
                                                         "DFlash2 pair")
    device: Device = flag("auto", help=DEVICE_HELP)
    dtype: Dtypes = flag("auto", cli=str, help=DTYPE_HELP + "; a comma list measures τ in each")
