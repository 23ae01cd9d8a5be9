// The aioparamsync wire contract.
//
// A strict superset of the founding IDL (ml_param_sync.thrift, kept verbatim
// beside this file): every struct, field id, field type, method and argument
// id of that file stands here unchanged, so a client generated from it, in
// any language, works against an aioparamsync node. Everything new is a new
// optional field, a new struct or a new method. tests/test_idl.py checks it.
//
// The founding methods keep their signatures, so a request they cannot serve
// is answered with a TApplicationException, which every Thrift client raises.
// (Adding a `throws` clause to them would make a founding client of a void
// method ignore the error: it does not know the new result field.) The new
// methods pull_parameters and push_parameters carry the typed ParameterError.

namespace cpp ml.param_sync
namespace java ml.param_sync
namespace py ml.param_sync

struct Parameter {
    1: required string name,
    // The raw bytes of the array, C order.
    2: required binary data,
    3: optional i32 version = 0,
    // numpy's dtype string (e.g. "<f4"); absent: plain bytes.
    4: optional string dtype,
    // The array's shape; absent with a dtype: one dimension.
    5: optional list<i64> shape,
    // Where this version was first applied: the node's id and its run
    // ("id@start-ms"). Set by nodes: on a replicated update it makes the
    // receiver keep version and origin (last writer wins on (version,
    // origin)); clients leave it out.
    6: optional string origin,
}

struct ParameterUpdate {
    1: required list<Parameter> params,
    2: required i64 timestamp
}

struct ParameterRequest {
    1: required list<string> param_names,
    2: optional i32 min_version = 0
}

struct ParameterResponse {
    1: required list<Parameter> params,
    2: required i64 timestamp
}

enum ErrorCode {
    // The request is malformed (empty or repeated names, bad values).
    BAD_REQUEST = 1,
    // A name that must exist does not.
    UNKNOWN_PARAMETER = 2,
    // The data does not match its dtype and shape, or the dtype is not numeric.
    SHAPE_MISMATCH = 3,
    // A limit of the node was exceeded (sizes, counts, versions).
    LIMIT_EXCEEDED = 4,
    // The node cannot take the request now (overloaded or shutting down).
    UNAVAILABLE = 5,
}

exception ParameterError {
    1: required ErrorCode code,
    2: required string message,
}

// What push_parameters applied: the version each parameter now has.
struct UpdateResult {
    1: required map<string, i32> versions,
    2: required i64 timestamp,
}

// Where a node can be reached, and who it is.
struct Member {
    1: required string node_id,
    2: required string host,
    3: required i32 port,
}

// What a node holds of one parameter (anti-entropy compares these).
struct DigestEntry {
    1: required string name,
    2: required i32 version,
    3: required string origin,
    4: required i64 nbytes,
}

// One peer link, as the node that keeps it sees it.
struct PeerInfo {
    1: required string node_id,
    2: required string address,
    // connecting, up, or backoff (unreachable; retried)
    3: required string state,
    // parameters waiting to be sent to the peer (at most one per name)
    4: required i64 outbox_depth,
    5: required i64 updates_sent,
    // updates replaced by newer ones before they were sent
    6: required i64 updates_coalesced,
    7: required i64 send_failures,
    // age of the oldest update waiting for the peer, in seconds
    8: required double lag_seconds,
    9: optional string last_error,
    // parameters pulled from the peer by anti-entropy
    10: required i64 repaired,
}

struct NodeInfo {
    1: required string node_id,
    // The aioparamsync version the node runs.
    2: required string version,
    3: required i64 parameter_count,
    4: required i64 parameter_bytes,
    // The node's timestamp: the largest update timestamp it has applied.
    5: required i64 timestamp,
    6: required double uptime_seconds,
    // Counters by name: requests, errors, connections, bytes in and out.
    7: required map<string, i64> counters,
    8: optional list<PeerInfo> peers,
}

service ParameterSyncService {
    ParameterResponse get_parameters(1: ParameterRequest request),
    void update_parameters(1: ParameterUpdate update),
    oneway void broadcast_update(1: ParameterUpdate update),

    // get_parameters with typed errors.
    ParameterResponse pull_parameters(1: ParameterRequest request)
        throws (1: ParameterError error),
    // update_parameters with typed errors, answering the versions applied.
    UpdateResult push_parameters(1: ParameterUpdate update)
        throws (1: ParameterError error),
    // Answers the node's id.
    string ping(),
    NodeInfo info(),

    // Cluster membership: the caller says who it is; the node adds it to its
    // peers and answers every member it knows, itself included.
    list<Member> announce(1: Member member),
    // (name, version, origin, size) of every parameter the node holds.
    list<DigestEntry> digest(),
}
