"""`kvik serve --grpc-port`: the gRPC front end (kvik.inference.v1.Inference, grpc.health.v1,
server reflection) on the same engine and request path as the HTTP API. Imported only when the flag
is given, so a server without it never loads grpcio."""
