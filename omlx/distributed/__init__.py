"""One model split across several Macs with mlx.distributed (``omlx serve --distributed``
under ``mlx.launch``): rank 0 serves HTTP and replays every runner call on the other
ranks over a control socket; ``omlx cluster`` writes and checks the hostfile."""
