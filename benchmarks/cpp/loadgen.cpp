// A load generator in C++ for the founding IDL (idl/ml_param_sync.thrift): Apache Thrift's
// own client (ParameterSyncServiceClient, framed transport, binary protocol), one thread and
// one connection per --conns, each calling as fast as its server answers. The client of
// benchmarks/bench_smallcalls.py: with a client this cheap, what is measured is the server.
//
//   loadgen --port P [--host 127.0.0.1] [--conns 8] [--size 4096] [--seconds 2]
//           [--op update|get] [--warmup 0.5]
//
// Connection i owns the parameter "lg<i>" (--size bytes): it stores it once, then calls
// --op on it in a loop for --warmup seconds (not counted) and --seconds (counted). A get
// checks the answer: one parameter of that name and size, else the run fails (exit 1).
// Prints one line of JSON: {"op", "conns", "size", "seconds", "calls", "calls_per_s",
// "p50_us", "p99_us"}; an error is printed to stderr and exits 1.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <thrift/TConfiguration.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TSocket.h>

#include "ParameterSyncService.h"

using apache::thrift::TConfiguration;
using apache::thrift::protocol::TBinaryProtocol;
using apache::thrift::transport::TFramedTransport;
using apache::thrift::transport::TSocket;
using namespace ml::param_sync;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kMaxFrameBytes = 256 * 1024 * 1024;

struct Options {
  std::string host = "127.0.0.1";
  int port = -1;
  int conns = 8;
  long size = 4096;
  double seconds = 2.0;
  double warmup = 0.5;
  bool update = true;
};

struct Outcome {
  long calls = 0;
  std::vector<float> latencies_us;  // (of the counted calls)
  std::string error;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "loadgen: %s\n", why.c_str());
  std::fprintf(stderr,
               "usage: loadgen --port P [--host H] [--conns N] [--size BYTES] [--seconds S]"
               " [--op update|get] [--warmup S]\n");
  std::exit(2);
}

double positive(const std::string& flag, const char* text, double low, double high) {
  char* end = nullptr;
  double value = std::strtod(text, &end);
  if (*text == '\0' || *end != '\0' || !(value >= low && value <= high)) {
    usage(flag + " takes a number in " + std::to_string(low) + ".." + std::to_string(high) +
          ", not " + text);
  }
  return value;
}

void drive(const Options& options, int index, Clock::time_point start, Clock::time_point end,
           Outcome& out) {
  try {
    auto config = std::make_shared<TConfiguration>(kMaxFrameBytes, kMaxFrameBytes);
    auto socket = std::make_shared<TSocket>(options.host, options.port, config);
    socket->setNoDelay(true);
    auto transport = std::make_shared<TFramedTransport>(socket, config);
    auto protocol = std::make_shared<TBinaryProtocol>(transport);
    ParameterSyncServiceClient client(protocol);
    transport->open();

    Parameter param;
    param.name = "lg" + std::to_string(index);
    param.data.assign(static_cast<size_t>(options.size), static_cast<char>('a' + index % 26));
    ParameterUpdate update;
    update.params.push_back(param);
    ParameterRequest request;
    request.param_names.push_back(param.name);
    client.update_parameters(update);

    out.latencies_us.reserve(1 << 20);
    for (;;) {
      auto before = Clock::now();
      if (before >= end) break;
      if (options.update) {
        update.timestamp += 1;
        client.update_parameters(update);
      } else {
        ParameterResponse response;
        client.get_parameters(response, request);
        if (response.params.size() != 1 || response.params[0].name != param.name ||
            static_cast<long>(response.params[0].data.size()) != options.size) {
          out.error = "get of " + param.name + " answered " +
                      std::to_string(response.params.size()) + " parameters";
          return;
        }
      }
      if (before >= start) {
        out.calls += 1;
        if (out.latencies_us.size() < out.latencies_us.capacity()) {
          auto took = std::chrono::duration<float, std::micro>(Clock::now() - before);
          out.latencies_us.push_back(took.count());
        }
      }
    }
    transport->close();
  } catch (const std::exception& e) {
    out.error = std::string("connection ") + std::to_string(index) + ": " + e.what();
  }
}

float percentile(std::vector<float>& values, double q) {
  if (values.empty()) return 0.0f;
  auto at = values.begin() + static_cast<long>(q * static_cast<double>(values.size() - 1));
  std::nth_element(values.begin(), at, values.end());
  return *at;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 == argc) usage("no value for " + flag);
    const char* value = argv[++i];
    if (flag == "--host") {
      options.host = value;
    } else if (flag == "--port") {
      options.port = static_cast<int>(positive(flag, value, 1, 65535));
    } else if (flag == "--conns") {
      options.conns = static_cast<int>(positive(flag, value, 1, 1024));
    } else if (flag == "--size") {
      options.size = static_cast<long>(positive(flag, value, 0, kMaxFrameBytes / 2));
    } else if (flag == "--seconds") {
      options.seconds = positive(flag, value, 0.01, 3600);
    } else if (flag == "--warmup") {
      options.warmup = positive(flag, value, 0, 3600);
    } else if (flag == "--op") {
      std::string op = value;
      if (op != "update" && op != "get") usage("--op is update or get, not " + op);
      options.update = op == "update";
    } else {
      usage("unknown flag " + flag);
    }
  }
  if (options.port < 0) usage("--port is required");

  auto start = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(options.warmup));
  auto end = start + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(options.seconds));
  std::vector<Outcome> outcomes(static_cast<size_t>(options.conns));
  std::vector<std::thread> threads;
  for (int i = 0; i < options.conns; ++i) {
    threads.emplace_back(drive, std::cref(options), i, start, end, std::ref(outcomes[i]));
  }
  for (auto& thread : threads) thread.join();

  long calls = 0;
  std::vector<float> latencies;
  for (auto& outcome : outcomes) {
    if (!outcome.error.empty()) {
      std::fprintf(stderr, "loadgen: %s\n", outcome.error.c_str());
      return 1;
    }
    calls += outcome.calls;
    latencies.insert(latencies.end(), outcome.latencies_us.begin(), outcome.latencies_us.end());
  }
  float p50 = percentile(latencies, 0.50);
  float p99 = percentile(latencies, 0.99);
  std::printf(
      "{\"op\": \"%s\", \"conns\": %d, \"size\": %ld, \"seconds\": %.3f, \"calls\": %ld, "
      "\"calls_per_s\": %.1f, \"p50_us\": %.1f, \"p99_us\": %.1f}\n",
      options.update ? "update" : "get", options.conns, options.size, options.seconds, calls,
      static_cast<double>(calls) / options.seconds, p50, p99);
  return 0;
}
