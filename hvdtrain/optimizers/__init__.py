"""What hvdtrain does to an optimizer, below the two Keras: the learning rate's scaling and
warmup as a schedule of either Keras (`rates`), and the hooks a distributed optimizer reads
in its step (`hooks`: whether it averages its gradients, which learning rate it shows). The
distributed optimizers themselves are each Keras's own (`hvdtrain.frontends`).
"""
