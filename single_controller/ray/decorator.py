"""The tutorial's import path for the decorator API (same objects as the base one)."""

from single_controller.base.decorator import *  # noqa: F401,F403
from single_controller.base.decorator import __all__  # noqa: F401
