"""Folders of small images, one subfolder per class (ImageNet's layout, as Keras's
`flow_from_directory` reads it): each class a bright row, so a model can learn them."""

import os

import numpy as np


def class_folders(root, sizes, classes=2, side=16, channels=3, ext="jpg", seed=0):
    """Writes `root/<split>/<class>/<i>.<ext>` for each `split: images per class` of `sizes`;
    returns `root`."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in sizes.items():
        for label in range(classes):
            folder = os.path.join(root, split, str(label))
            os.makedirs(folder, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 40, (side, side, channels)[: 2 + (channels > 1)])
                pixels[label % side] = 255
                image = Image.fromarray(pixels.astype("uint8"))
                image.save(os.path.join(folder, f"{i}.{ext}"))
    return root
