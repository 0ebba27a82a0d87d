"""The catalog's metadata functions (set-namespace, set-labels, set-annotations), each case written
from the function's documented behaviour and run twice: the second run must change nothing
(idempotency). Comments and key order survive."""

from __future__ import annotations

import pytest

from fnkernel.runtime_server.krm.functions.set_metadata import set_annotations, set_labels
from fnkernel.runtime_server.krm.functions.set_namespace import set_namespace
from fnkernel.runtime_server.krm.resources.resourcelist import FunctionFailure, ResourceList
from tests.krm.cases import item, rl_of, run, run_twice

NS_CONFIG = """
apiVersion: v1
kind: ConfigMap
metadata: {name: ns}
data: {namespace: prod}
"""


class TestSetNamespace:
    def test_namespaced_objects_move_and_unset_ones_are_set(self) -> None:
        """docs/krm.md, "set-namespace": a known namespaced kind gets the namespace, set or not;
        a kind the function does not know is namespaced only if it already has a namespace."""
        rl = run_twice(
            set_namespace,
            rl_of(
                """
                - apiVersion: apps/v1
                  kind: Deployment
                  metadata: {name: web, namespace: dev}
                - apiVersion: v1
                  kind: Service
                  metadata: {name: web}
                - apiVersion: example.com/v1
                  kind: Widget
                  metadata: {name: w, namespace: dev}
                - apiVersion: example.com/v1
                  kind: Widget
                  metadata: {name: unscoped}
                - apiVersion: kpt.dev/v1
                  kind: Kptfile
                  metadata: {name: app}
                """,
                NS_CONFIG,
            ),
        )
        namespaces = [i["metadata"].get("namespace") for i in rl.items]
        assert namespaces == ["prod", "prod", "prod", None, None]
        assert (
            rl.results[0]["message"]
            == 'namespace [default dev] updated to "prod", 3 value(s) changed'
        )

    def test_cluster_scoped_objects_get_no_namespace_and_namespace_objects_are_renamed(
        self,
    ) -> None:
        rl = run_twice(
            set_namespace,
            rl_of(
                """
                - apiVersion: v1
                  kind: Namespace
                  metadata: {name: dev}
                - apiVersion: rbac.authorization.k8s.io/v1
                  kind: ClusterRole
                  metadata: {name: reader}
                - apiVersion: v1
                  kind: ConfigMap
                  metadata: {name: c, namespace: dev}
                """,
                NS_CONFIG,
            ),
        )
        assert item(rl, "Namespace")["metadata"]["name"] == "prod"
        assert "namespace" not in item(rl, "ClusterRole")["metadata"]

    def test_binding_subjects_crd_webhook_and_apiservice_follow(self) -> None:
        rl = run_twice(
            set_namespace,
            rl_of(
                """
                - apiVersion: rbac.authorization.k8s.io/v1
                  kind: ClusterRoleBinding
                  metadata: {name: b}
                  subjects:
                  - {kind: ServiceAccount, name: default, namespace: dev}
                  - {kind: User, name: ada}
                - apiVersion: apiextensions.k8s.io/v1
                  kind: CustomResourceDefinition
                  metadata: {name: widgets.example.com}
                  spec:
                    conversion:
                      webhook:
                        clientConfig:
                          service: {name: conv, namespace: dev}
                - apiVersion: apiregistration.k8s.io/v1
                  kind: APIService
                  metadata: {name: v1.example.com}
                  spec:
                    service: {name: api, namespace: dev}
                """,
                NS_CONFIG,
            ),
        )
        subjects = item(rl, "ClusterRoleBinding")["subjects"]
        assert subjects[0]["namespace"] == "prod" and "namespace" not in subjects[1]
        crd = item(rl, "CustomResourceDefinition")
        assert (
            crd["spec"]["conversion"]["webhook"]["clientConfig"]["service"]["namespace"] == "prod"
        )
        assert item(rl, "APIService")["spec"]["service"]["namespace"] == "prod"

    def test_depends_on_annotations_follow_the_objects_they_name(self) -> None:
        rl = run_twice(
            set_namespace,
            rl_of(
                """
                - apiVersion: v1
                  kind: ConfigMap
                  metadata: {name: cfg, namespace: dev}
                - apiVersion: apps/v1
                  kind: Deployment
                  metadata:
                    name: web
                    namespace: dev
                    annotations:
                      config.kubernetes.io/depends-on: /namespaces/dev/ConfigMap/cfg
                - apiVersion: apps/v1
                  kind: Deployment
                  metadata:
                    name: other
                    namespace: dev
                    annotations:
                      config.kubernetes.io/depends-on: /namespaces/elsewhere/ConfigMap/x
                """,
                NS_CONFIG,
            ),
        )
        notes = item(rl, "Deployment", "web")["metadata"]["annotations"]
        assert notes["config.kubernetes.io/depends-on"] == "/namespaces/prod/ConfigMap/cfg"
        untouched = item(rl, "Deployment", "other")["metadata"]["annotations"]
        assert untouched["config.kubernetes.io/depends-on"] == "/namespaces/elsewhere/ConfigMap/x"

    def test_local_config_is_skipped(self) -> None:
        rl = run_twice(
            set_namespace,
            rl_of(
                """
                - apiVersion: v1
                  kind: ConfigMap
                  metadata:
                    name: local
                    namespace: dev
                    annotations: {config.kubernetes.io/local-config: "true"}
                - apiVersion: v1
                  kind: ConfigMap
                  metadata: {name: real, namespace: dev}
                """,
                NS_CONFIG,
            ),
        )
        assert item(rl, "ConfigMap", "local")["metadata"]["namespace"] == "dev"
        assert item(rl, "ConfigMap", "real")["metadata"]["namespace"] == "prod"

    def test_set_namespace_config_with_a_matcher_changes_only_matching(self) -> None:
        rl = run_twice(
            set_namespace,
            rl_of(
                """
                - apiVersion: v1
                  kind: ConfigMap
                  metadata: {name: a, namespace: dev}
                - apiVersion: v1
                  kind: ConfigMap
                  metadata: {name: b, namespace: keep}
                """,
                """
                apiVersion: fn.kpt.dev/v1alpha1
                kind: SetNamespace
                metadata: {name: ns}
                namespace: prod
                namespaceMatcher: dev
                """,
            ),
        )
        assert item(rl, "ConfigMap", "a")["metadata"]["namespace"] == "prod"
        assert item(rl, "ConfigMap", "b")["metadata"]["namespace"] == "keep"

    def test_package_context_configmap_names_the_namespace(self) -> None:
        rl = run_twice(
            set_namespace,
            rl_of(
                """
                - apiVersion: v1
                  kind: ConfigMap
                  metadata: {name: a, namespace: dev}
                """,
                """
                apiVersion: v1
                kind: ConfigMap
                metadata: {name: kptfile.kpt.dev}
                data: {name: from-context}
                """,
            ),
        )
        assert item(rl, "ConfigMap")["metadata"]["namespace"] == "from-context"

    @pytest.mark.parametrize(
        ("config", "message"),
        [
            (
                "apiVersion: v1\nkind: ConfigMap\ndata: {other: x}",
                "`data.namespace` should not be empty",
            ),
            ("apiVersion: v9\nkind: Widget", "unknown functionConfig Kind=Widget"),
        ],
    )
    def test_a_bad_config_is_an_error_result(self, config: str, message: str) -> None:
        rl = run(
            set_namespace, rl_of("- {apiVersion: v1, kind: ConfigMap, metadata: {name: a}}", config)
        )
        assert rl.has_errors()
        assert message in rl.results[-1]["message"]

    def test_several_upstream_namespaces_need_a_matcher(self) -> None:
        rl = run(
            set_namespace,
            rl_of(
                """
                - apiVersion: v1
                  kind: ConfigMap
                  metadata:
                    name: a
                    namespace: x
                    annotations: {internal.kpt.dev/upstream-identifier: "|ConfigMap|x|a"}
                - apiVersion: v1
                  kind: ConfigMap
                  metadata:
                    name: b
                    namespace: y
                    annotations: {internal.kpt.dev/upstream-identifier: "|ConfigMap|y|b"}
                """,
                NS_CONFIG,
            ),
        )
        assert rl.has_errors() and "namespaceMatcher" in rl.results[-1]["message"]
        assert item(rl, "ConfigMap", "a")["metadata"]["namespace"] == "x"


LABELS = """
apiVersion: v1
kind: ConfigMap
metadata: {name: labels}
data: {app: web, tier: front}
"""


class TestSetLabels:
    def test_metadata_labels_are_added_or_replaced(self) -> None:
        rl = run_twice(
            set_labels,
            rl_of(
                """
                - apiVersion: v1
                  kind: ConfigMap
                  metadata:
                    name: c
                    labels: {app: old, keep: me}
                """,
                LABELS,
            ),
        )
        assert dict(item(rl, "ConfigMap")["metadata"]["labels"]) == {
            "app": "web",
            "keep": "me",
            "tier": "front",
        }

    def test_service_selector_is_created(self) -> None:
        rl = run_twice(
            set_labels,
            rl_of("- {apiVersion: v1, kind: Service, metadata: {name: s}, spec: {}}", LABELS),
        )
        assert dict(item(rl, "Service")["spec"]["selector"]) == {"app": "web", "tier": "front"}

    def test_deployment_selector_and_template_are_created(self) -> None:
        rl = run_twice(
            set_labels,
            rl_of(
                """
                - apiVersion: apps/v1
                  kind: Deployment
                  metadata: {name: d}
                  spec:
                    template:
                      spec: {containers: [{name: c, image: nginx}]}
                """,
                LABELS,
            ),
        )
        spec = item(rl, "Deployment")["spec"]
        assert spec["selector"]["matchLabels"]["app"] == "web"
        assert spec["template"]["metadata"]["labels"]["tier"] == "front"

    def test_job_selector_is_only_updated_when_present(self) -> None:
        rl = run_twice(
            set_labels,
            rl_of(
                """
                - apiVersion: batch/v1
                  kind: Job
                  metadata: {name: j}
                  spec:
                    template: {spec: {}}
                - apiVersion: policy/v1
                  kind: PodDisruptionBudget
                  metadata: {name: p}
                  spec:
                    selector:
                      matchLabels: {app: old}
                """,
                LABELS,
            ),
        )
        job = item(rl, "Job")["spec"]
        assert "selector" not in job
        assert job["template"]["metadata"]["labels"]["app"] == "web"
        assert item(rl, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]["app"] == "web"

    def test_statefulset_claim_templates_and_networkpolicy_peers(self) -> None:
        """docs/krm.md, "set-labels": a NetworkPolicy's selectors are optional, so only the keys
        they already have are updated; a claim template's labels are created."""
        rl = run_twice(
            set_labels,
            rl_of(
                """
                - apiVersion: apps/v1
                  kind: StatefulSet
                  metadata: {name: db}
                  spec:
                    volumeClaimTemplates:
                    - metadata: {name: data}
                - apiVersion: networking.k8s.io/v1
                  kind: NetworkPolicy
                  metadata: {name: np}
                  spec:
                    podSelector: {matchLabels: {role: db, app: old}}
                    ingress:
                    - from:
                      - podSelector: {matchLabels: {role: api}}
                      - namespaceSelector: {}
                """,
                LABELS,
            ),
        )
        claims = item(rl, "StatefulSet")["spec"]["volumeClaimTemplates"]
        assert claims[0]["metadata"]["labels"]["app"] == "web"
        policy = item(rl, "NetworkPolicy")["spec"]
        assert policy["podSelector"]["matchLabels"] == {"role": "db", "app": "web"}
        peers = policy["ingress"][0]["from"]
        assert peers[0]["podSelector"]["matchLabels"] == {"role": "api"}
        assert "podSelector" not in peers[1]

    def test_no_template_is_created_and_local_config_is_skipped(self) -> None:
        """docs/krm.md, "set-labels": a Deployment without a pod template gets its selector
        but no template; a local-config object is not labelled; every place visited counts."""
        rl = run_twice(
            set_labels,
            rl_of(
                """
                - apiVersion: apps/v1
                  kind: Deployment
                  metadata: {name: d}
                  spec: {replicas: 3}
                - apiVersion: v1
                  kind: ConfigMap
                  metadata:
                    name: local
                    annotations: {config.kubernetes.io/local-config: "true"}
                """,
                LABELS,
            ),
        )
        spec = item(rl, "Deployment")["spec"]
        assert "template" not in spec
        assert dict(spec["selector"]["matchLabels"]) == {"app": "web", "tier": "front"}
        assert "labels" not in item(rl, "ConfigMap")["metadata"]
        assert rl.results[-1]["message"] == "set 4 labels in total"

    def test_set_labels_custom_resource_config(self) -> None:
        rl = run_twice(
            set_labels,
            rl_of(
                "- {apiVersion: v1, kind: ConfigMap, metadata: {name: c}}",
                "apiVersion: fn.kpt.dev/v1alpha1\nkind: SetLabels\nmetadata: {name: l}\nlabels: {env: staging}",
            ),
        )
        assert dict(item(rl, "ConfigMap")["metadata"]["labels"]) == {"env": "staging"}

    def test_missing_config_fails_with_an_info_result(self) -> None:
        """docs/krm.md, "set-labels": without a config the function says so and fails."""
        rl = ResourceList.parse(
            b"kind: ResourceList\nitems: [{apiVersion: v1, kind: ConfigMap, metadata: {name: c}}]\n"
        )
        with pytest.raises(FunctionFailure):
            set_labels(rl)
        assert [dict(r) for r in rl.results] == [
            {"message": "`FunctionConfig` is not given", "severity": "info"}
        ]


ANNOTATIONS = """
apiVersion: fn.kpt.dev/v1alpha1
kind: SetAnnotations
metadata: {name: a}
annotations: {owner: team-a, "example.com/tier": gold}
"""


class TestSetAnnotations:
    def test_metadata_annotations_are_added(self) -> None:
        rl = run_twice(
            set_annotations,
            rl_of("- {apiVersion: v1, kind: ConfigMap, metadata: {name: c}}", ANNOTATIONS),
        )
        assert dict(item(rl, "ConfigMap")["metadata"]["annotations"]) == {
            "owner": "team-a",
            "example.com/tier": "gold",
        }

    def test_existing_annotations_are_kept_or_replaced(self) -> None:
        rl = run_twice(
            set_annotations,
            rl_of(
                """
                - apiVersion: v1
                  kind: ConfigMap
                  metadata:
                    name: c
                    annotations: {owner: someone, note: keep}
                """,
                ANNOTATIONS,
            ),
        )
        notes = item(rl, "ConfigMap")["metadata"]["annotations"]
        assert notes["owner"] == "team-a" and notes["note"] == "keep"

    def test_pod_templates_are_annotated(self) -> None:
        rl = run_twice(
            set_annotations,
            rl_of(
                """
                - apiVersion: apps/v1
                  kind: Deployment
                  metadata: {name: d}
                  spec: {template: {spec: {}}}
                - apiVersion: batch/v1
                  kind: CronJob
                  metadata: {name: cj}
                  spec:
                    jobTemplate:
                      spec: {template: {spec: {}}}
                """,
                ANNOTATIONS,
            ),
        )
        deployment = item(rl, "Deployment")["spec"]["template"]["metadata"]["annotations"]
        assert deployment["owner"] == "team-a"
        cron = item(rl, "CronJob")["spec"]["jobTemplate"]
        assert cron["metadata"]["annotations"]["owner"] == "team-a"
        assert cron["spec"]["template"]["metadata"]["annotations"]["owner"] == "team-a"

    def test_selectors_are_not_touched(self) -> None:
        rl = run_twice(
            set_annotations,
            rl_of("- {apiVersion: v1, kind: Service, metadata: {name: s}, spec: {}}", ANNOTATIONS),
        )
        assert "selector" not in item(rl, "Service")["spec"]

    def test_configmap_config_data_are_the_annotations(self) -> None:
        rl = run_twice(
            set_annotations,
            rl_of(
                "- {apiVersion: v1, kind: Secret, metadata: {name: s}}",
                "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\ndata: {reviewed: 'yes'}",
            ),
        )
        assert item(rl, "Secret")["metadata"]["annotations"]["reviewed"] == "yes"


def test_comments_and_key_order_survive() -> None:
    data = rl_of(
        """
        - apiVersion: apps/v1 # the workload
          kind: Deployment
          metadata:
            name: web # keep this name
            namespace: dev
          spec:
            replicas: 3 # three, on purpose
            template:
              spec: {}
        """,
        NS_CONFIG,
    )
    out = run(set_namespace, data)
    out.document.pop("results")
    text = out.to_bytes().decode()
    assert "apiVersion: apps/v1 # the workload" in text
    assert "name: web # keep this name" in text
    assert "replicas: 3 # three, on purpose" in text
    keys = list(item(out, "Deployment"))
    assert keys == ["apiVersion", "kind", "metadata", "spec"]
    assert text == data.decode().replace("namespace: dev", "namespace: prod")
