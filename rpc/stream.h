// Stream endpoint types named by generated signatures of streaming methods.
//
// The stream runtime (flow-controlled ServerWriter::async_write,
// ClientReader::async_read, half-close, ...) is not in this release: a Server
// answers streaming methods UNIMPLEMENTED and a generated stub's streaming
// call completes UNIMPLEMENTED. The types exist so that services and stubs
// with streaming methods compile today and keep their signatures.
#pragma once

namespace rdmarpc {

template <typename W>
class ServerWriter;  // server side of a server-streaming method
template <typename R>
class ServerReader;  // server side of a client-streaming method
template <typename W, typename R>
class ServerReaderWriter;  // server side of a bidirectional method

// Client ends, delivered by the stub's completion handler.
template <typename R>
class ClientReader {};
template <typename W>
class ClientWriter {};
template <typename W, typename R>
class ClientReaderWriter {};

}  // namespace rdmarpc
