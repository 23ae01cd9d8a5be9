// Apache Thrift's C++ server for the founding IDL (idl/ml_param_sync.thrift): the baseline
// of benchmarks/bench_node.py (variant "cpp") and bench_scaleout.py (--baseline cpp).
//
// The server a Thrift user would deploy: TThreadPoolServer, framed transport, binary
// protocol, one pool thread per connection. Parameters live in a hash map under a
// reader-writer lock. Built by benchmarks/cppserver.py (thrift --gen cpp, g++ -lthrift).
//
//   param_server [--host 127.0.0.1] [--port 0] [--threads 16]
//
// Prints "listening on HOST:PORT" (the bound port) once listening; SIGTERM or SIGINT
// stops it (exit 0).

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <thrift/TConfiguration.h>
#include <thrift/concurrency/ThreadFactory.h>
#include <thrift/concurrency/ThreadManager.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/server/TThreadPoolServer.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TServerSocket.h>
#include <thrift/transport/TSocket.h>

#include "ParameterSyncService.h"

using apache::thrift::TConfiguration;
using apache::thrift::concurrency::ThreadFactory;
using apache::thrift::concurrency::ThreadManager;
using apache::thrift::protocol::TBinaryProtocolFactory;
using apache::thrift::server::TThreadPoolServer;
using apache::thrift::transport::TFramedTransport;
using apache::thrift::transport::TServerSocket;
using apache::thrift::transport::TSocket;
using apache::thrift::transport::TTransport;
using apache::thrift::transport::TTransportFactory;
using namespace ml::param_sync;

namespace {

// Thrift 0.17 refuses frames above ~16 MB and messages above 100 MB by default; the
// benchmarks send up to 256 MiB, as the node accepts (its --max-frame-bytes).
constexpr int kMaxFrameBytes = 256 * 1024 * 1024;

class Handler : public ParameterSyncServiceIf {
 public:
  void get_parameters(ParameterResponse& out, const ParameterRequest& request) override {
    std::shared_lock lock(mutex_);
    for (const auto& name : request.param_names) {
      auto it = store_.find(name);
      if (it != store_.end() && it->second.version >= request.min_version) {
        out.params.push_back(it->second);
      }
    }
    out.timestamp = timestamp_;
  }

  void update_parameters(const ParameterUpdate& update) override {
    // Copied outside the lock, swapped in under it; the old values freed after it.
    std::vector<Parameter> incoming(update.params);
    {
      std::unique_lock lock(mutex_);
      for (auto& param : incoming) {
        Parameter& slot = store_[param.name];
        param.__set_version(slot.version + 1);
        std::swap(slot, param);
      }
      timestamp_ = std::max(timestamp_, update.timestamp);
    }
  }

  void broadcast_update(const ParameterUpdate& update) override { update_parameters(update); }

 private:
  std::shared_mutex mutex_;
  std::unordered_map<std::string, Parameter> store_;
  int64_t timestamp_ = 0;
};

// TFramedTransport counts the bytes it reads against the message limit over the life of a
// connection, not per message (Thrift 0.17): a connection that has read 256 MiB in all is
// closed. Each message read starts the count again.
class Framed : public TFramedTransport {
 public:
  using TFramedTransport::TFramedTransport;
  uint32_t readEnd() override {
    uint32_t n = TFramedTransport::readEnd();
    resetConsumedMessageSize();
    return n;
  }
};

// TFramedTransportFactory, with the frame and message limits raised to kMaxFrameBytes.
class FramedFactory : public TTransportFactory {
 public:
  std::shared_ptr<TTransport> getTransport(std::shared_ptr<TTransport> inner) override {
    return std::make_shared<Framed>(inner, config_);
  }

 private:
  std::shared_ptr<TConfiguration> config_ =
      std::make_shared<TConfiguration>(kMaxFrameBytes, kMaxFrameBytes);
};

// TServerSocket that listens once: main() listens first, to print the port the kernel
// picked; serve() calls listen() again, which would bind a second socket. Its connections'
// sockets take messages up to kMaxFrameBytes too (a TSocket's own limit is 100 MB: a
// 128 MiB update closed the connection).
class ListenOnce : public TServerSocket {
 public:
  using TServerSocket::TServerSocket;
  void listen() override {
    if (!isOpen()) TServerSocket::listen();
  }

 protected:
  std::shared_ptr<TSocket> createSocket(THRIFT_SOCKET client) override {
    return std::make_shared<TSocket>(client, pChildInterruptSockReader_, config_);
  }

 private:
  std::shared_ptr<TConfiguration> config_ =
      std::make_shared<TConfiguration>(kMaxFrameBytes, kMaxFrameBytes);
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "param_server: %s\n", why);
  std::fprintf(stderr, "usage: param_server [--host H] [--port P] [--threads N]\n");
  std::exit(2);
}

int number(const char* text) {
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < 0 || value > 65535) {
    usage(("not a number in 0..65535: " + std::string(text)).c_str());
  }
  return static_cast<int>(value);
}

}  // namespace

int main(int argc, char** argv) {
  std::string host = "127.0.0.1";
  int port = 0;
  int threads = 16;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 == argc) usage(("no value for " + flag).c_str());
    const char* value = argv[++i];
    if (flag == "--host") {
      host = value;
    } else if (flag == "--port") {
      port = number(value);
    } else if (flag == "--threads") {
      threads = number(value);
    } else {
      usage(("unknown flag " + flag).c_str());
    }
  }
  if (threads < 1) usage("--threads must be at least 1");

  // SIGTERM and SIGINT go to one thread of their own (blocked here, before any other thread
  // starts, so every thread inherits the mask), which stops the server.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto pool = ThreadManager::newSimpleThreadManager(threads);
  pool->threadFactory(std::make_shared<ThreadFactory>());
  pool->start();
  auto socket = std::make_shared<ListenOnce>(host, port);
  TThreadPoolServer server(
      std::make_shared<ParameterSyncServiceProcessor>(std::make_shared<Handler>()), socket,
      std::make_shared<FramedFactory>(), std::make_shared<TBinaryProtocolFactory>(), pool);

  try {
    socket->listen();
  } catch (const apache::thrift::TException& e) {
    std::fprintf(stderr, "param_server: cannot listen on %s:%d: %s\n", host.c_str(), port,
                 e.what());
    return 1;
  }
  std::printf("listening on %s:%d\n", host.c_str(), socket->getPort());
  std::fflush(stdout);

  std::thread stopper([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    server.stop();
  });
  server.serve();
  stopper.join();
  return 0;
}
