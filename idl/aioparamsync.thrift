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

// How gradients are folded into a stored parameter w (g: the gradient).
struct Rule {
    // "sum": w += g. "sgd": with weight decay wd and momentum mu (buffer b,
    // b = g' on the first step): g' = g + wd*w; b = mu*b + g'; w -= lr*b
    // (torch.optim.SGD). "adam": torch.optim.Adam's rule, its state (m, v,
    // step) kept by the node. "adagrad" (embedding tables' rows only):
    // torch.optim.Adagrad's rule, s += g^2; w -= lr * g / (sqrt(s) + eps),
    // s starting at initial_accumulator. For rows, "adam" is lazy: only the
    // rows a push touches step, each by its own step count. Other kinds are
    // refused.
    1: required string kind,
    2: optional double lr = 0.01,
    3: optional double momentum = 0.0,
    4: optional double weight_decay = 0.0,
    5: optional double beta1 = 0.9,
    6: optional double beta2 = 0.999,
    7: optional double eps = 1e-8,
    8: optional double initial_accumulator = 0.0,
    // A gradient holding NaN or inf is refused (BAD_REQUEST, naming the
    // parameter and how many values are not finite; nothing of its push is
    // folded) unless this is set: one worker's diverged step would otherwise
    // poison the value every worker reads.
    9: optional bool allow_nonfinite = false,
}

struct Parameter {
    1: required string name,
    // The raw bytes of the array, C order.
    2: required binary data,
    3: optional i32 version = 0,
    // numpy's dtype string (e.g. "<f4"); absent: plain bytes.
    4: optional string dtype,
    // The array's shape; absent with a dtype: one dimension (or, updating a
    // stored parameter of that size, its shape: see `replace`).
    5: optional list<i64> shape,
    // Where this version was first applied: the node's id and its run
    // ("id@start-ms"). Set by nodes: on a replicated update it makes the
    // receiver keep version and origin (last writer wins on (version,
    // origin)); clients leave it out.
    6: optional string origin,
    // How `data` is encoded; absent: the array's own bytes. dtype and shape
    // always describe the decoded array. "fp16", "bf16": its values in that
    // type; "int8": round(value / scale) as int8; "topk": the values (in
    // dtype) at the flat positions `indices` holds (little-endian int64),
    // every other element zero; "zlib": its bytes, deflated. A node stores
    // and answers decoded arrays unless a request asks for an encoding.
    7: optional string encoding,
    8: optional double scale,
    9: optional binary indices,
    // The rule push_gradients folds gradients into this parameter by. Set by
    // an update (where the parameter is created, or to change it); an update
    // without one keeps the stored rule.
    10: optional Rule rule,
    // A piece of a parameter too large for one message (a Thrift binary, and
    // a frame, hold less than 2 GiB): `data` is bytes [offset, offset +
    // len(data)) of the parameter's `total_bytes`; dtype, shape, version,
    // origin and rule are the whole parameter's. The pieces of one upload
    // share its `upload_id`; a node applies the parameter, as one update,
    // once it holds every byte. A read answers a parameter larger than the
    // request's max_inline_bytes with `total_bytes` and no data.
    11: optional i64 offset,
    12: optional i64 total_bytes,
    13: optional string upload_id,
    // Set by an update that replaces the parameter with another dtype or
    // shape. Once a parameter has a dtype and shape, an update with another
    // layout is refused (SHAPE_MISMATCH) unless it sets this. Plain bytes
    // (no dtype) of the stored size, and data of the stored dtype and size
    // without a shape, keep the stored layout; a lossy encoding's data (fp16,
    // bf16, int8) of a wider float dtype is stored in the parameter's.
    14: optional bool replace,
}

struct ParameterUpdate {
    1: required list<Parameter> params,
    2: required i64 timestamp
    // Set by a node replicating to its peers (a broadcast_update): the
    // sending node's id. The receiver merges such an update (each parameter
    // keeps the version and origin it was given: last writer wins on
    // (version, origin)) and sends it on to no one. Clients leave it out:
    // their updates are applied as new versions, whatever origins they hold.
    3: optional string from_peer,
    // The epoch of the topology the caller routed by (see
    // ParameterRequest.epoch): set, a parameter the node does not hold is
    // answered MOVED; absent, it is passed on to its primary.
    4: optional i64 epoch,
    // When to answer: "1" once the primary applied (and, with a data
    // directory, logged) it; "all" once every live replica did. Absent: the
    // node's --acks.
    5: optional string acks,
    // Set on each part of a call cut among nodes (by a routed client, or by a
    // node passing parts on): "ID:K", the same for every part, K the number
    // of keys the call writes in all. A checkpoint's cut (see CutRequest)
    // takes all of such a call's keys or none.
    6: optional string call,
}

// Bytes in shared memory, between a node and a client on its host: `size`
// bytes at `offset` of the client's `segment`, a memfd named "FD:NAME" (the
// client's descriptor of it, and the name it gave it: aioparamsync- and 16
// hex digits), which the node opens as /proc/PID/fd/FD, PID the socket's
// peer. Only over a Unix socket whose peer is of the node's user.
struct SharedRegion {
    1: required string segment,
    2: required i64 offset,
    3: required i64 size,
}

struct ParameterRequest {
    1: required list<string> param_names,
    2: optional i32 min_version = 0,
    // Long poll (stale-synchronous training): wait up to this many
    // milliseconds for every requested name to exist with version >=
    // min_version; answered as soon as they do, or with a TIMEOUT error.
    3: optional i32 wait_ms,
    // A delta pull: the version the caller holds of each name; a name comes
    // back only when the node has a newer version of it.
    4: optional map<string, i32> known_versions,
    // Every parameter the node holds instead of param_names (with
    // known_versions: every one changed).
    5: optional bool all_names,
    // Encode the answered data so ("fp16", "bf16", "int8", "zlib"; see
    // Parameter.encoding); absent: raw.
    6: optional string encoding,
    // Answer a parameter larger than this without its data (total_bytes
    // set); read it in pieces (see Parameter.offset). So too the parameters
    // past this many bytes of data in all: no answer carries more.
    7: optional i64 max_inline_bytes,
    // Read one piece: bytes [piece_offset, piece_offset + piece_bytes) of
    // the one parameter named (at most what remains).
    8: optional i64 piece_offset,
    9: optional i64 piece_bytes,
    // With known_versions: the origin of the version held of each name. A
    // name also comes back when the node holds the same version from another
    // writer that won (last-writer-wins: the larger origin at equal versions).
    10: optional map<string, string> known_origins,
    // The epoch of the topology the caller routed by (see Topology). Set: the
    // node serves what it holds and answers MOVED for a name it does not
    // hold. Absent (a client that knows no topology): the node asks the
    // holders of what it does not hold, so every node answers every name.
    11: optional i64 epoch,
    // Set (a peer's repair): the node answers from its own store, the keys as
    // stored (partitions and manifests as they are), whatever it holds by
    // the placement; it passes no name on, and leaves out those it lacks.
    12: optional bool as_stored,
    // Set: each parameter is answered without its rule (Parameter.rule
    // absent; a manifest keeps its own), for a caller that only wants the
    // arrays: less to send and to read.
    13: optional bool without_rules,
    // Set (with without_rules): the node may answer raw parameters that share
    // a dtype in ParameterResponse.packed, several in one block, rather than
    // one Parameter each (a read of many small tensors). A node older than
    // this field answers them in params, as it may do anyway.
    14: optional bool packed,
    // Set (with packed), by a client on this node's Unix socket: a region of
    // shared memory where the node may write the answer's blocks' bytes
    // (Packed.shared) rather than send them; a node that cannot, or older
    // than this field, sends them.
    15: optional SharedRegion shared,
}

// Many parameters (or gradients) of one dtype in one block (see
// ParameterRequest.packed, GradientPush.packed).
struct Packed {
    1: required list<string> names,
    // numpy's dtype string (e.g. "<f4"), every parameter's.
    2: required string dtype,
    // Each parameter's shape, one after another: its number of dimensions,
    // then each dimension ([1, 1024, 2, 3, 4]: one of (1024,), then one of
    // (3, 4)).
    3: required list<i64> shapes,
    // Their raw bytes, C order, one after another (no padding between).
    4: required binary data,
    // In an answer: each parameter's version and origin (as Parameter's), in
    // names' order.
    5: optional list<i32> versions,
    6: optional list<string> origins,
    // Set: the block's bytes are these of shared memory, not `data` (which
    // is empty): in an answer, within the read's ParameterRequest.shared; in
    // a push, a client's region (sent so only to a node that has answered a
    // read so), left as it is until the push is answered.
    7: optional SharedRegion shared,
}

struct ParameterResponse {
    1: required list<Parameter> params,
    2: required i64 timestamp
    // Parameters answered in blocks (see ParameterRequest.packed), besides
    // those in params: no name is in both.
    3: optional list<Packed> packed,
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
    // A wait (long poll, barrier) reached its deadline.
    TIMEOUT = 6,
    // A caller that routed by a topology asked a node for what it does not
    // hold: its topology is stale. ParameterError.epoch is the node's epoch;
    // ask a node for the topology again.
    MOVED = 7,
    // A write that may or may not have been applied: the node applied it but a
    // live replica did not confirm it (acks=all), or a node it was passed on to
    // did not answer, or the node stopped first. Every other code of a write
    // means nothing of it was applied. Read it back, or send a gradient push
    // again under its request id (it folds once).
    INDETERMINATE = 8,
}

exception ParameterError {
    1: required ErrorCode code,
    2: required string message,
    // With MOVED: the epoch of the node's topology.
    3: optional i64 epoch,
}

// What push_parameters applied: the version each parameter now has.
struct UpdateResult {
    1: required map<string, i32> versions,
    2: required i64 timestamp,
}

// Gradients for push_gradients.
struct GradientPush {
    // One Parameter per gradient: name, data (encoded or not), dtype, shape;
    // the parameter must exist with a rule, and the gradient its shape.
    1: required list<Parameter> grads,
    // Chosen by the caller, unique per push: a push sent again with the same
    // id (a retry) is applied once and answered the first outcome. The parts
    // of one push (forwarded, or routed: epoch set) are told apart by their
    // names.
    2: optional string request_id,
    3: optional i64 timestamp,
    // Set by a node that passes the push on to the node that applies
    // gradients of these names (it is not passed on again).
    4: optional bool forwarded,
    // As in ParameterUpdate: the caller's topology epoch, and when to answer.
    5: optional i64 epoch,
    6: optional string acks,
    // As in ParameterUpdate: the call this part is of.
    7: optional string call,
    // More gradients, raw, several of a dtype in a block (each named once in
    // the push, here or in grads): a client sends them so only to a node that
    // has answered a read in blocks (a node older than this field would
    // leave them out).
    8: optional list<Packed> packed,
}

// An embedding table: rows of `dim` values by int64 id, each made on its
// first touch (pull or push) by the initializer, a pure function of (table,
// seed, id), so every replica and every restart makes the same row. Rows are
// placed in `buckets` buckets (by a hash of the id), each bucket a key as a
// parameter's name is: its replicas hold its rows, its primary folds them.
struct Table {
    1: required string name,
    2: required i32 dim,
    // numpy's dtype string of the values ("<f4" when absent; "<f2", "<f8"
    // and "bfloat16" too).
    3: optional string dtype,
    // "zeros" (when absent), "uniform" (U(-scale, scale)) or "normal"
    // (N(0, scale^2)).
    4: optional string init,
    5: optional double scale,
    6: optional i64 seed,
    // How row gradients fold: "sgd" (lr only), "adagrad" (when absent, with
    // lr 0.01) or "adam".
    7: optional Rule rule,
    // Fixed at creation (64 when absent).
    8: optional i32 buckets,
    // Rows untouched this long are dropped (and made anew on their next touch);
    // absent or 0: never.
    9: optional double row_ttl_seconds,
    // Set by a node passing the table on to the other members.
    10: optional bool forwarded,
}

// Read rows of a table.
struct RowsRequest {
    1: required string table,
    // The ids, little-endian int64, repeats allowed.
    2: required binary ids,
    // Answer the rows so encoded ("fp16", "bf16", "int8"); absent: raw.
    3: optional string encoding,
    // As in ParameterRequest: the caller's topology epoch (set: a node
    // answers MOVED for rows of a bucket it does not hold; absent: it asks
    // the buckets' holders).
    4: optional i64 epoch,
    // As ParameterRequest.shared: a region of the caller's shared memory the
    // node may write the raw rows into (the answer's Rows.shared says so).
    5: optional SharedRegion shared,
}

// Rows (a pull's answer, a push's gradients): one array of (count, dim)
// values, C order, in the order of the ids they were asked or sent by.
struct Rows {
    1: required i64 count,
    2: required i32 dim,
    // numpy's dtype string of the decoded values.
    3: required string dtype,
    // The values, raw or as `encoding` says: "fp16", "bf16" (the values in
    // that type), "int8" (round(value / scale) of the row, a float32 scale
    // per row in `scales`).
    4: required binary data,
    5: optional string encoding,
    6: optional binary scales,
    // Set: the raw values are these of shared memory, not `data` (which is
    // empty): in an answer, within the pull's RowsRequest.shared; in a push, a
    // client's region (as Packed.shared), left as it is until it is answered.
    7: optional SharedRegion shared,
}

// Row gradients for push_row_gradients: the gradients of repeated ids are
// summed, then each row folds once.
struct RowPush {
    1: required string table,
    // little-endian int64, one per gradient row
    2: required binary ids,
    3: required Rows grads,
    // As in GradientPush.
    4: optional string request_id,
    5: optional i64 epoch,
    6: optional string acks,
    // Set by a node passing a part on to the buckets' primary.
    7: optional bool forwarded,
    // Set: grads are the rows' new values, not gradients. Each row is set to
    // its values (made first where new; its rule's state made anew), at a
    // new version. The ids may not repeat.
    8: optional bool assign,
}

// What a row push did.
struct RowsResult {
    // distinct rows folded
    1: required i64 rows,
    // of them, rows made by this push (their first touch)
    2: required i64 created,
}

// Rows a bucket's primary sends its replicas (and a node hands on when a
// bucket moves): every value and every state of each row, which the
// receiver keeps unless it holds the row at the same or a newer version.
struct RowDelta {
    1: required Table table,
    2: required i32 bucket,
    3: required binary ids,
    // little-endian int64 per row: the row's version (its folds so far)
    4: required binary versions,
    5: required binary rows,
    // The rule's state arrays of the rows, each (count, dim) of the values'
    // working dtype (adagrad: s; adam: m, v), then adam's step per row
    // (little-endian int64).
    6: optional list<binary> state,
    7: required string from_peer,
    // Answering bucket_rows: the rows the bucket holds in all.
    8: optional i64 total,
    // Answering bucket_rows: the holder's clock when it answered (seconds since
    // the epoch): a caller asks for what was touched since, next time.
    9: optional double as_of,
}

// Ask a node for every row it holds of one bucket (a node that takes a bucket
// over, or repairs it).
struct BucketRequest {
    1: required string table,
    2: required i32 bucket,
    // A page: the rows from offset on (in the holder's order), at most limit of
    // them (absent: every one). RowDelta.total says how many the bucket holds.
    3: optional i64 offset,
    4: optional i64 limit,
    // Only the rows touched (made, folded, merged or read) at or after this time of
    // the holder's clock (seconds since the epoch; see RowDelta.as_of): what
    // changed since the caller last asked. Pages are of those rows.
    5: optional double touched_since,
}

// A worker arriving at a barrier (bulk-synchronous training).
struct BarrierRequest {
    1: required string group,
    2: required string worker,
    // The step the worker has finished; the barrier opens when every one of
    // world_size workers has reached at least this step.
    3: required i64 step,
    4: required i32 world_size,
    // How long to wait (milliseconds); absent: until the call's deadline.
    5: optional i32 wait_ms,
    // As in ParameterRequest: the caller's topology epoch (the primary of the
    // group's key holds the barrier).
    6: optional i64 epoch,
}

struct BarrierResult {
    1: required string group,
    2: required i64 step,
    // The workers that passed (each at that step or later).
    3: required list<string> workers,
}

// A watch: which keys, and the version of each the caller has seen. A name is
// reported by its own key when it is stored whole, by its manifest's key
// (name, NUL, "#m") when it is stored as partitions; a partition's key
// (name, NUL, "#", index) may be watched too, so a client that learned the
// partitions from the manifest watches them where they are.
struct WatchRequest {
    // The keys to watch (names, or a partitioned parameter's keys) ...
    1: optional list<string> names,
    // ... or every key held here whose parameter's name starts with this
    // ("": every one). One of the two.
    2: optional string prefix,
    // The version of each key the caller has seen: a key is answered when the
    // node holds another version of it (or the caller has seen none).
    3: optional map<string, i32> known_versions,
    // Hold the call up to this long for a change, then answer what changed
    // (nothing: an empty map). 0: answer at once. Absent: the node's default.
    4: optional i32 wait_ms,
    // The epoch of the topology the caller routed by (see Topology): names
    // this node does not hold are answered MOVED. In a cluster whose nodes
    // hold a share of the keys each, a watch is routed.
    5: optional i64 epoch,
}

// What changed: each key watched whose version differs from known_versions
// (or is not in it), with the version held here.
struct WatchResult {
    1: required map<string, i32> versions,
}

// A caller the node is holding: a long poll or a barrier, and who it waits for.
struct Waiter {
    // "pull" or "barrier"
    1: required string kind,
    // the barrier's group and step, or the names and min_version awaited
    2: required string what,
    // the workers not yet arrived, or the names not yet at min_version
    3: required list<string> waiting_for,
    4: required double seconds,
    // the worker (barrier) or the caller's address
    5: optional string who,
}

// Where a node can be reached, and who it is.
struct Member {
    1: required string node_id,
    2: required string host,
    3: required i32 port,
    // What the member says of itself, when it announces: "joining" (taking
    // its keys; it holds none yet), "up", "leaving" (handing its keys off)
    // or "left".
    4: optional string state,
    // The epoch of its topology: a node adopts a larger one it is told.
    5: optional i64 epoch,
    // The replication factor it was started with (0: every node holds every
    // key). The nodes of one cluster share one: a node refuses a member that
    // says another (it does not add it), and a link to one.
    6: optional i32 replication_factor,
    // Only on the first member of an answer to announce (the node answering):
    // why it refused the caller (not added: e.g. their replication factors
    // differ), naming both sides' values. The caller's link is then
    // "refused" (see PeerInfo.state), and tries again now and then.
    7: optional string refused,
    // The keys the member claims (key -> the epoch it claimed it at): it is
    // their primary, placement balanced by bytes (see aioparamsync/placement.py).
    8: optional map<string, i64> claims,
    // The keys it is taking, not claimed yet: it pulls them, and they are
    // replicated to it meanwhile, as to a member joining.
    9: optional map<string, i64> claiming,
}

// One member of the cluster, as the node answering sees it.
struct TopologyMember {
    1: required string node_id,
    2: required string host,
    3: required i32 port,
    // "up" (holds keys, answers), "down" (holds keys, does not answer; it
    // leaves placement after the failure timeout), "failed" (down longer:
    // its keys are held by others), "joining", "leaving", "left".
    4: required string state,
}

// Who holds what: the members and the replication factor. A key's replicas
// are the first replication_factor members (every one, when 0 or more than
// there are) of those "up" or "down", ranked by rendezvous hashing
// (blake2b-64 of member id, NUL, key; highest first; see
// aioparamsync/placement.py); its primary is the first of them that is up.
struct Topology {
    // Grows with every change of membership the node sees.
    1: required i64 epoch,
    2: required list<TopologyMember> members,
    3: required i32 replication_factor,
    // Parameters of more elements than this many bytes of float32 (plain
    // bytes: of more bytes) are stored as partitions of as many elements
    // (the last: the rest), each a one-dimensional parameter of the same
    // dtype placed by its own key (name, NUL, "#", index), and a manifest
    // (key: name, NUL, "#m"; placed by the name; plain bytes, JSON: format
    // 1, dtype, shape, elements, per). A read of the name answers a routed
    // caller (epoch set) the manifest, any other the whole parameter; its
    // version is its oldest partition's. 0: every parameter stored whole.
    4: optional i64 partition_bytes,
    // The answering node's --acks ("1" or "all"): what a write it
    // acknowledges waits for, when the write names none. With "all", a write
    // acknowledged is at every live replica of its keys, so a routed client
    // reads from any of them by default (aioparamsync/client/routing.py).
    5: optional string acks,
    // Keys a member claims (key -> the member), of the members up or down:
    // each is the primary of its key, the others the first
    // replication_factor - 1 of the key's ranking without it. Placement
    // balanced by bytes (see aioparamsync/placement.py).
    6: optional map<string, string> claims,
}

// Which digest entries to answer: with for_node, those of the keys whose
// replicas (over members, replication_factor as in Topology) include it;
// with names, those of the names; both: both conditions.
struct DigestRequest {
    1: optional string for_node,
    2: optional list<string> members,
    3: optional i32 replication_factor,
    4: optional list<string> names,
    // With for_node: the claims placement counts (see Topology.claims).
    5: optional map<string, string> claims,
    // A hand-off asks (the caller drops the keys answered): only the keys the
    // node will hold by its own view, now or in the pending placement; none
    // while it leaves or has left. A caller whose view is behind takes it for
    // a holder it no longer is.
    6: optional bool handing,
}

// Between members: raise keys' versions (see lift). A node back with its data
// directory held copies of versions above those of the same keys written
// anew while it was away; it yields to those later writes, and asks their
// primary to raise their versions above the ones it held, so that no reader
// sees a key's version go back (see docs/cluster.md, "A node restarted with
// its data").
struct LiftRequest {
    // Key -> the version to raise it to (at least 1).
    1: optional map<string, i32> floors,
}

// Stop nodes (so that a job's cluster ends with its workers).
struct ShutdownRequest {
    // Every member this node knows too (default), or this node alone.
    1: optional bool cluster,
    // Each node with a data directory takes no more writes and writes its
    // final snapshot before it answers; else it writes it as it stops.
    2: optional bool snapshot,
}

// What a shutdown set going.
struct ShutdownResult {
    // The nodes that answered and are stopping (this one included).
    1: required i32 stopping,
    // Of those, the ones that wrote their final snapshot before answering.
    2: required i32 snapshots,
    // Members that could not be told, as host:port.
    3: optional list<string> unreached,
}

// What a node holds of one parameter (anti-entropy compares these).
struct DigestEntry {
    1: required string name,
    2: required i32 version,
    3: required string origin,
    4: required i64 nbytes,
    // The node holds it as it read it from its data directory at start (or
    // kept it through a lost lease), written to by nothing since: a copy from
    // before, which yields to a live one (see docs/cluster.md, "A node
    // restarted with its data").
    5: optional bool recovered,
}

// A checkpoint's cut, one step of it at a node (aioparamsync-ctl checkpoint
// takes them at every member; see docs/cluster.md):
// "hold": hold every client's write not yet applied (replication and rows go
//   on); answer the calls cut among nodes applied here lately, each with the
//   keys it wrote here (the caller finds those some node applied and another
//   holds);
// "admit": let the held and coming writes of `calls` in (they were begun before
//   the cut); answer those calls as "hold" does;
// "take": keep what the node holds now as the cut's (still holding writes);
//   answer the cut's keys;
// "release": let every write in (once every member took its part);
// "read": answer the cut's values of `names` (keys as stored);
// "end": forget the cut (and let every write in).
// A hold ends by itself after hold_ms, and a cut taken is forgotten once
// unread for a minute.
struct CutRequest {
    1: required string id,
    2: required string phase,
    3: optional list<string> calls,
    4: optional list<string> names,
    // With "hold": let writes in again after this long whatever comes
    // (absent: 10000; at most 60000).
    5: optional i32 hold_ms,
}

struct CutResult {
    // hold, admit: each call (ParameterUpdate.call) and the keys it wrote here.
    1: optional map<string, list<string>> calls,
    // take: what the cut holds here.
    2: optional list<DigestEntry> keys,
    // read: the values asked for, as stored.
    3: optional list<Parameter> params,
    // hold, admit: the writes held here now.
    4: optional i32 held,
}

// One peer link, as the node that keeps it sees it.
struct PeerInfo {
    1: required string node_id,
    2: required string address,
    // connecting, up, backoff (unreachable; retried), or refused (the peer
    // cannot be in this node's cluster, last_error says why: e.g. another
    // replication factor; retried now and then)
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
    // Long polls and barriers waiting now.
    9: optional list<Waiter> waiting,
    // The cluster as this node sees it.
    10: optional Topology topology,
    // Keys this node holds but is no replica of any more: being handed off.
    11: optional i64 keys_moving,
    // Keys this node is primary of with fewer than their replicas live.
    12: optional i64 under_replicated,
    // This node's own state (see Member.state).
    13: optional string state,
    // Which per-call path the node runs: "compiled" (its C extensions) or "pure"
    // (Python only: built without a compiler, or AIOPARAMSYNC_NO_EXT=1).
    14: optional string fast_path,
    // With --coordinator: where the members are kept ("etcd://HOST:PORT,... PREFIX").
    15: optional string coordinator,
    // Why this node takes no writes now (it cannot renew its lease on the
    // coordinator); unset while it takes them.
    16: optional string fenced,
    // Where a client on this node's host may connect instead of its TCP port:
    // "unix:PATH" (--unix-socket), or "unix:@NAME", an abstract Unix socket the
    // node listens on unless told not to (--no-local-socket) or serving TLS. There
    // it shares memory with the client (see SharedRegion).
    17: optional string local_socket,
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
    // (name, version, origin, size) of every parameter the node holds. With
    // buckets, also of every bucket of an embedding table it holds rows of:
    // the bucket's placement key ("\0rows\0TABLE\0BUCKET"), version 0, origin
    // "", the bytes of its rows' values (placement balanced by bytes counts them).
    list<DigestEntry> digest(1: optional bool buckets),

    // Fold gradients into parameters by each one's rule, atomically; answers
    // the versions made. Idempotent by request_id.
    UpdateResult push_gradients(1: GradientPush push)
        throws (1: ParameterError error),
    // Wait until world_size workers of the group reach the step.
    BarrierResult barrier(1: BarrierRequest request)
        throws (1: ParameterError error),
    // Answer the versions of the keys watched that changed (see WatchRequest),
    // held until one does, up to wait_ms.
    WatchResult watch(1: WatchRequest request) throws (1: ParameterError error),

    // The cluster as this node sees it: clients route by it.
    Topology topology(),
    // The digest (see digest) of the keys the request selects.
    list<DigestEntry> digest_for(1: DigestRequest request)
        throws (1: ParameterError error),
    // Between members: raise the versions of the keys this node is the
    // primary of to their floors, where lower (a write: logged and
    // replicated as any), and answer the digest of the keys named that it
    // holds; the others it leaves as they are.
    list<DigestEntry> lift(1: LiftRequest request) throws (1: ParameterError error),
    // A planned leave: the node hands every key it holds to its next
    // holders, answers how many it handed off, and exits.
    i64 drain(1: i32 wait_ms) throws (1: ParameterError error),
    // Stop the node, and every member it knows (no hand-off: they all stop),
    // each after its final snapshot where it has a data directory. Refused
    // over TLS unless the node verifies client certificates.
    ShutdownResult shutdown(1: ShutdownRequest request) throws (1: ParameterError error),

    // Embedding tables. create_table makes the table on every member (the
    // same table again is no error; another with the same name is) and
    // answers it, defaults filled in.
    Table create_table(1: Table table) throws (1: ParameterError error),
    list<Table> tables() throws (1: ParameterError error),
    // The rows of the ids, in their order, made where new.
    Rows pull_rows(1: RowsRequest request) throws (1: ParameterError error),
    // Fold row gradients by the table's rule, each row atomically; a push is
    // applied once by its request_id.
    RowsResult push_row_gradients(1: RowPush push) throws (1: ParameterError error),
    // Between nodes: rows for buckets' replicas (see RowDelta), every bucket
    // a fold changed in one message; answers how many rows it kept.
    i64 replicate_rows(1: list<RowDelta> deltas) throws (1: ParameterError error),
    RowDelta bucket_rows(1: BucketRequest request) throws (1: ParameterError error),

    // A step of a checkpoint's cut (see CutRequest).
    CutResult cut(1: CutRequest request) throws (1: ParameterError error),
}
