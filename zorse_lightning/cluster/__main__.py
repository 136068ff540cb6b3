"""``python -m zorse_lightning.cluster cluster=NAME``: print an inventory as a table."""

from zorse_lightning.apps.cluster_app import main

if __name__ == "__main__":
    main()
