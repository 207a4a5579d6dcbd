"""The featcal Space: zero-shot CLIP classification with a FeatCal-calibrated vision tower.

Settings come from space_config.json (written by `featcal space push`), overridden by the Space
variables MODEL_ID, BASE_MODEL_ID and TASKS_FILE. Run it locally with `featcal space`.
"""

import logging
import signal
import sys
from pathlib import Path

from featcal.errors import FeatcalError
from featcal.space import SpaceSettings, create_space

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
try:
    settings = SpaceSettings.from_app_dir(Path(__file__).parent)
    space = create_space(settings)
except FeatcalError as exc:  # a setting, the model or a task that cannot serve: one line in the Space's log
    logging.getLogger("featcal.space").error("%s", exc)
    sys.exit(2)
demo = space.demo  # for `gradio app.py` (reload mode)

if __name__ == "__main__":
    # A stop request (SIGTERM) ends the launch like Ctrl-C, so that close() removes the temporary folder of
    # example images gathered from the test splits.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # Address and port come from GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (set by Hugging Face Spaces).
    try:
        space.launch()
    finally:
        space.close()
