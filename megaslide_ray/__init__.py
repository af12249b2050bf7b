"""megaslide-ray: fine-tune video diffusion transformers larger than device memory.

The package holds one sub-package per concern and, at its top, the command lines
(``python -m megaslide_ray.NAME``, ``megaslide NAME``). docs/architecture.md ("Where each piece
lives") is the code map and the layer rule, which tests/test_layers.py checks against every import.
"""

import importlib.metadata as _metadata
import importlib.util as _util
import os as _os
import warnings as _warnings


def check_no_foreign_kernels() -> None:
    """Say what to do when the Hugging Face ``kernels`` distribution is installed.

    This project's top-level package ``kernels`` (3D-DSA) and the Hub's ``kernels`` package (a
    dependency of transformers >= 5.25) share one import name: installed together, one hides the
    other. Where theirs is what ``import kernels`` finds, this project cannot run: ImportError. Where
    ours is (a checkout's directory comes first on the path), this project runs, but transformers
    (and with it diffusers' Wan loading) imports our package as its own and fails: a warning.
    Both say the fix.
    """
    try:
        version = _metadata.version("kernels")
    except _metadata.PackageNotFoundError:
        return
    fix = ("Fix: pip install 'transformers>=5,<5.25' && pip uninstall -y kernels && "
           "pip install --force-reinstall --no-deps -e .   (from the megaslide-ray checkout)")
    what = (f"the Hugging Face package 'kernels' {version} is installed in this environment (it comes with "
            "transformers >= 5.25); it shares the top-level import name 'kernels' with megaslide-ray's "
            "kernels package")
    spec = _util.find_spec("kernels")
    origin = spec.origin if spec is not None and spec.origin else ""
    if not _os.path.exists(_os.path.join(_os.path.dirname(origin), "dsa_reference.py")):
        raise ImportError(f"{what}, and 'import kernels' finds theirs ({origin}): megaslide-ray cannot run. {fix}")
    _warnings.warn(f"{what}; 'import kernels' finds this project's, so transformers and diffusers' Wan loading "
                   f"may fail to import. {fix}", RuntimeWarning, stacklevel=2)


check_no_foreign_kernels()
