"""``python -m zorse_lightning.export CHECKPOINT OUT.pt``: a zorse checkpoint as a plain ``state_dict``."""

from zorse_lightning.apps.export_app import main

if __name__ == "__main__":
    main()
